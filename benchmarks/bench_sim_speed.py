"""Benchmark 12, the simulator's speed: one hour of the Azure conversation
trace (``AzureLLMInferenceTrace_conv.csv``, 19,365 requests) replayed by
two instances of the tiny Llama at once (both on the same hour), through
``vllm-kv-sim``'s scenarios, timed on the wall clock of this machine.

    .venv/bin/python benchmarks/bench_sim_speed.py [--minutes 60] [--trace-dir FOLDER]
        [--scenarios even,autoscale] [--step-time a=0.005,b=0.0005,c=0.00005]
        [--aiconfigurator Qwen/Qwen3-8B --model Qwen/Qwen3-8B --budget 16G]

The step-time model is the linear one by default (the machine's own CPU
fit is of the same form); with ``--aiconfigurator`` each instance is timed
by aiconfigurator-core's tables instead (``make sim``; run it with
``.venv-sim``'s packages on ``PYTHONPATH``). The figure is the wall time of
each scenario (vLLM imported and the traces read before the clock starts),
the simulated seconds and device steps it covered, and their ratio. The
target (issue 50): one hour for two instances in under 5 minutes.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import _common as c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace-dir", default=None, help="the Azure traces' folder (default: the package's copy)")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--scenarios", default="even,autoscale")
    p.add_argument("--model", default=None, help="model folder (default: the tiny Llama, built when missing)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--budget", default="256M", help="the KV cache budget the two instances share")
    p.add_argument("--step-time", default="a=0.005,b=0.0005,c=0.00005")
    p.add_argument("--aiconfigurator", default=None, help="time the steps with aiconfigurator-core's model (make sim)")
    p.add_argument("--system", default="h100_sxm")
    p.add_argument("--tag", default="sim_speed")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model is None:
        args.model = c.model_path(argparse.Namespace(model=None))
    timed = f",aiconfigurator={args.aiconfigurator}" if args.aiconfigurator else ""
    instance = f"model={args.model},max_model_len={args.max_model_len},trace=conv{timed}"
    argv = [
        "--budget", args.budget, "--minutes", str(args.minutes),
        "--step-time", args.step_time, "--system", args.system, "--scenarios", args.scenarios,
        "--instance", f"name=a,{instance}", "--instance", f"name=b,{instance}",
    ]  # fmt: skip
    if args.trace_dir:
        argv += ["--trace-dir", args.trace_dir]
    started = time.perf_counter()
    from vllm_kv_cache_limit.sim import cli, scenarios

    setup, names = cli.setup_from(cli.parser().parse_args(argv))
    prepared = time.perf_counter() - started
    print(f"vLLM imported, traces read, step times ready: {prepared:.1f} s; "
          f"{sum(len(t) for t in setup.traffic)} requests over {args.minutes:g} min")  # fmt: skip
    rows: list[dict[str, Any]] = []
    for name in names:
        mark = time.perf_counter()
        result = scenarios.run(name, setup)
        wall = time.perf_counter() - mark
        figures = result["instances"].values()
        rows.append(
            {
                "scenario": name,
                "wall_s": wall,
                "simulated_s": result["simulated_s"],
                "device_steps": result["device_steps"],
                "requests": sum(f["requests"] for f in figures),
                "finished": sum(f["finished"] for f in figures),
                "steps_per_s": result["device_steps"] / wall if wall else None,
                "simulated_per_wall": result["simulated_s"] / wall if wall else None,
                "goodput_req_s": result["goodput_req_s"],
            }
        )
        print(f"{name}: {wall:.1f} s wall for {result['simulated_s']:.0f} s simulated, {result['device_steps']} steps")
    columns = [
        ("scenario", "scenario"), ("wall_s", "wall s"), ("simulated_s", "simulated s"), ("device_steps", "steps"),
        ("requests", "reqs"), ("finished", "done"), ("steps_per_s", "steps/s"), ("simulated_per_wall", "x real time"),
    ]  # fmt: skip
    c.print_table(rows, columns, digits=1)
    total = prepared + sum(r["wall_s"] for r in rows)
    print(f"total wall time {total:.1f} s (target: under 300 s per scenario for an hour)")
    meta = {"argv": argv, "prepare_s": prepared, "total_s": total, "step_time": args.aiconfigurator or args.step_time}
    c.save(args.tag, rows, meta)


if __name__ == "__main__":
    main()
