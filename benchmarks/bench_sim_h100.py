"""Benchmark 10, models sharing an H100 in ``vllm-kv-sim``: aiconfigurator-core's
measured step times (h100_sxm, vLLM 0.24.0 tables), the Azure traces 2023
(the package's copy), every scenario side by side (no-cap, even, plan,
autoscale, oracle), then the autoscaler's sensitivity to its hysteresis
(``--shrink-after``) and floors.

    PYTHONPATH=.venv-sim/lib/python3.11/site-packages .venv/bin/python benchmarks/bench_sim_h100.py \\
        [--models 2|3] [--start-min 4] [--minutes 2] [--budget 4G] [--time-scale 1]
        [--shrink-after 2,10,30] [--floors 256M,512M] [--reference-budget 40G]

Two models: Qwen3-8B on the conversation trace and Llama-3.1-8B on the code
trace; three: Qwen3-1.7B on the conversation trace from ``--third-start-min``
beside them. The KV cache budget is chosen small so that KV capacity, not
compute, is what limits the even split: the reference run (the oracle at
``--reference-budget``, where KV never runs short) shows what the device's
compute alone allows on the same traffic. Goodput is counted as requests
that meet the SLO (TTFT <= --slo-ttft, TPOT <= --slo-tpot) over the
traffic's span, so the scenarios compare on the same requests; the
simulator's own goodput/s (over the run, drain included) is kept beside it.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import time
from typing import Any

import _common as c

MODELS = {
    "qwen": ("Qwen/Qwen3-8B", "conv"),
    "llama": ("meta-llama/Meta-Llama-3.1-8B", "code"),
    "qwen-small": ("Qwen/Qwen3-1.7B", "conv"),
}


def _argv(args: argparse.Namespace, budget: str) -> list[str]:
    argv = [
        "--system", args.system, "--budget", budget, "--start-min", str(args.start_min),
        "--minutes", str(args.minutes), "--slo-ttft", str(args.slo_ttft), "--slo-tpot", str(args.slo_tpot),
        "--drain", str(args.drain),
    ]  # fmt: skip
    from vllm_kv_cache_limit.sim.aiconfigurator import model_folder

    names = list(MODELS)[: args.models]
    for name in names:
        model, trace = MODELS[name]
        start = f",start_min={args.third_start_min}" if name == "qwen-small" else ""
        # The folder of the config aiconfigurator-core ships: the plan scenario's vllm-kv-plan reads model= as is.
        folder = model_folder(model) or model
        argv += [
            "--instance",
            f"name={name},model={folder},aiconfigurator={model},max_model_len={args.max_model_len},"
            f"trace={trace},time_scale={args.time_scale}{start}",
        ]
    return argv


def _row(setting: str, result: dict[str, Any], wall: float) -> dict[str, Any]:
    row: dict[str, Any] = {"setting": setting, "scenario": result["scenario"], "wall_s": wall}
    good = 0
    for name, f in result["instances"].items():
        ok = round((f["slo_attainment"] or 0.0) * f["requests"])
        good += ok
        row[f"{name}_good"] = ok
        row[f"{name}_reqs"] = f["requests"]
        ttft = f["ttft_s"]["p90"]
        row[f"{name}_ttft_p90"] = None if ttft is None else ttft
        row[f"{name}_preempt"] = f["preemptions"]
        row[f"{name}_changes"] = f["limit_changes"]
        if f.get("error"):
            row[f"{name}_error"] = f["error"][:80]
    row["good"] = good
    row["goodput_req_s"] = result["goodput_req_s"]
    row["device_busy"] = result["device_busy"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, choices=(2, 3), default=2)
    p.add_argument("--system", default="h100_sxm")
    p.add_argument("--start-min", type=float, default=4.0)
    p.add_argument("--third-start-min", type=float, default=34.0)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--budget", default="4G")
    p.add_argument("--reference-budget", default="40G", help="the oracle's budget where KV never runs short")
    p.add_argument("--scenarios", default="all")
    p.add_argument("--shrink-after", default="2,10,30", help="autoscale hysteresis values to try, seconds")
    p.add_argument("--floors", default="", help="autoscale floors to try beside the plugin's default, e.g. 512M")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--drain", type=float, default=120.0)
    p.add_argument("--tag", default="sim_h100")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
    from vllm_kv_cache_limit.logic.sizes import parse_size
    from vllm_kv_cache_limit.sim import cli, scenarios

    setup, names = cli.setup_from(cli.parser().parse_args(_argv(args, args.budget) + ["--scenarios", args.scenarios]))
    rows: list[dict[str, Any]] = []

    def run(setting: str, name: str, which: Any) -> None:
        mark = time.perf_counter()
        try:
            row = _row(setting, scenarios.run(name, which), time.perf_counter() - mark)
        except KVCacheMaxMemoryError as exc:  # a setting the plugin refuses: said, and the others still run
            print(f"{setting} {name}: refused: {exc}", flush=True)
            rows.append({"setting": setting, "scenario": name, "refused": str(exc)})
            return
        rows.append(row)
        print(f"{setting} {name}: {row['good']} good, {row['wall_s']:.0f} s wall", flush=True)

    reference, _ = cli.setup_from(cli.parser().parse_args(_argv(args, args.reference_budget)))
    run(f"reference {args.reference_budget}", "oracle", reference)
    for name in names:
        run(f"budget {args.budget}", name, setup)
    for shrink in [float(s) for s in args.shrink_after.split(",") if s]:
        if shrink == setup.shrink_after_s:
            continue  # the default, already run above
        varied = copy.copy(setup)
        varied.shrink_after_s = shrink
        run(f"shrink-after {shrink:g}", "autoscale", varied)
    for floor in [s for s in args.floors.split(",") if s]:
        varied = copy.copy(setup)
        varied.floors = [parse_size(floor)] * len(setup.specs)
        run(f"floor {floor}", "autoscale", varied)
    best = {r["scenario"]: r.get("good") for r in rows if r["setting"] == f"budget {args.budget}"}
    for row in rows:
        for base in ("even", "plan", "oracle"):
            if best.get(base) and "good" in row:
                row[f"vs_{base}"] = row["good"] / best[base]
    instance_names = list(MODELS)[: args.models]
    columns = [("setting", "setting"), ("scenario", "scenario"), ("good", "good")]
    for name in instance_names:
        columns += [(f"{name}_good", f"{name} good/reqs"), (f"{name}_ttft_p90", f"{name} TTFT p90 s")]
        columns += [(f"{name}_preempt", f"{name} preempt"), (f"{name}_changes", f"{name} changes")]
    columns += [("vs_even", "/even"), ("vs_plan", "/plan"), ("vs_oracle", "/oracle"), ("device_busy", "busy")]
    for row in rows:
        for name in instance_names:
            if f"{name}_reqs" in row:
                row[f"{name}_good"] = f"{row[f'{name}_good']}/{row[f'{name}_reqs']}"
    c.print_table(rows, columns, digits=2)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=c.REPO)
    policy = ["vllm_kv_cache_limit/logic/autoscale_policy.py", "vllm_kv_cache_limit/hooks/runtime/autoscaler.py"]
    dirty = subprocess.run(["git", "status", "--short", *policy], capture_output=True, text=True, cwd=c.REPO)
    meta = {
        "argv": _argv(args, args.budget),
        "commit": commit.stdout.strip(),
        "policy_uncommitted": dirty.stdout.strip(),
        "shrink_after_default": setup.shrink_after_s,
        "total_s": time.perf_counter() - started,
    }
    state = f"uncommitted changes: {meta['policy_uncommitted']!r}" if meta["policy_uncommitted"] else "as committed"
    print(f"measured at commit {meta['commit']}, the autoscaler's policy {state}; {meta['total_s']:.0f} s in all")
    c.save(args.tag, rows, meta)


if __name__ == "__main__":
    main()
