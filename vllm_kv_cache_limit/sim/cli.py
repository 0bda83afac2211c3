"""``vllm-kv-sim``: several vLLM instances on one device, replayed on
traffic with vLLM's own scheduler and the plugin's own autoscaler, on a
virtual clock; the settings compared side by side."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.sim import metrics, traffic
from vllm_kv_cache_limit.sim.step_time import StepTimeError, StepTimeModel, parse_linear

TRACE_DIR_ENV = "VLLM_KV_SIM_TRACES"
"""The folder of the Azure traces (``--trace-dir``'s default; without either, the package's copy)."""
INSTANCE_KEYS = {
    "name": str,
    "model": str,
    "max_model_len": int,
    "block_size": int,
    "max_num_seqs": int,
    "trace": str,
    "rate": float,
    "cv": float,
    "prompt": int,
    "output": int,
    "time_scale": float,
    "start_min": float,
    "prompt_scale": float,
    "output_scale": float,
    "floor": str,
    "step_time": str,
    "aiconfigurator": str,
    "seed": int,
    "weights": str,
    "activations": str,
}
EXAMPLE = "name=a,model=models/tiny-llama,max_model_len=1024,trace=conv"


class UsageError(ValueError):
    """A command-line value that cannot work; the message quotes it and says what would."""


def parse_instance(text: str) -> dict[str, Any]:
    """``key=value,...`` of one ``--instance``."""
    values: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in INSTANCE_KEYS:
            raise UsageError(
                f"--instance {text!r}: {part!r} is not key=value with a key of {', '.join(INSTANCE_KEYS)}; "
                f"for example --instance {EXAMPLE}"
            )
        try:
            values[key] = INSTANCE_KEYS[key](raw)
        except ValueError:
            raise UsageError(f"--instance {text!r}: {key}={raw!r} is not a {INSTANCE_KEYS[key].__name__}.") from None
    for needed in ("model", "max_model_len"):
        if needed not in values:
            raise UsageError(f"--instance {text!r} has no {needed}=; for example --instance {EXAMPLE}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-kv-sim",
        description="Simulate vLLM instances sharing one device: vLLM's scheduler and this plugin's autoscaler "
        "on a virtual clock, each setting run on the same traffic, compared side by side.",
    )
    p.add_argument("--instance", action="append", required=True, help=f"one instance, key=value,...: {EXAMPLE}")
    p.add_argument("--budget", required=True, help="KV cache memory the instances share, e.g. 64M or 40GiB")
    p.add_argument(
        "--scenarios", default="all", help="comma-separated: no-cap, even, plan, autoscale, oracle (default all)"
    )
    p.add_argument("--step-time", default="a=0.005,b=0.0005,c=0.00005", help="linear step time a=,b=,c= or JSON")
    p.add_argument("--system", default="h100_sxm", help="aiconfigurator-core's system for aiconfigurator=MODEL")
    p.add_argument(
        "--trace-dir",
        default=os.environ.get(TRACE_DIR_ENV),
        help=f"the Azure traces' folder (default ${TRACE_DIR_ENV}, else the copy in the package)",
    )
    p.add_argument("--start-min", type=float, default=0.0, help="the trace slice's start, minutes into the trace")
    p.add_argument("--minutes", type=float, default=1.0, help="the trace slice's length (and synthetic traffic's)")
    p.add_argument("--shrink-after", type=float, default=30.0, help="the autoscaler's hysteresis, seconds")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO, seconds")
    p.add_argument("--drain", type=float, default=600.0, help="seconds after the last arrival the run goes on")
    p.add_argument("--device-memory", help="the device's total memory (default: --system's with aiconfigurator=)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="each instance's in no-cap")
    p.add_argument("--overlap", type=float, default=0.0, help="MPS: how far steps overlap, 0 (time-sharing) to 1")
    p.add_argument("--plot", metavar="PATH", help="write a timeline PNG per scenario (PATH-SCENARIO.png)")
    p.add_argument("--progress", action="store_true", help="a progress bar on stderr (default: when a TTY)")
    p.add_argument("--recommend", action="store_true", help="search floors, caps and hysteresis for goodput")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", action="store_true", help="show vLLM's and the autoscaler's log lines")
    return p


def _step_time(values: dict[str, Any], args: argparse.Namespace) -> StepTimeModel:
    if "aiconfigurator" in values:
        from vllm_kv_cache_limit.sim.aiconfigurator import AiconfiguratorStepTime

        return AiconfiguratorStepTime(values["aiconfigurator"], args.system)
    return parse_linear(values.get("step_time", args.step_time).replace(";", ","))


def _traffic(values: dict[str, Any], args: argparse.Namespace) -> list[traffic.Arrival]:
    tokens = traffic.Tokens(
        values.get("prompt_scale", 1.0), values.get("output_scale", 1.0), max_total=values["max_model_len"]
    )
    kind = values.get("trace", "poisson")
    seconds = args.minutes * 60
    if kind in ("poisson", "gamma"):
        cv = 1.0 if kind == "poisson" else values.get("cv", 3.0)
        return traffic.gamma(
            values.get("rate", 1.0), cv, seconds, values.get("prompt", 256), values.get("output", 64),
            values.get("seed", 0), tokens,
        )  # fmt: skip
    return traffic.load_azure(
        traffic.trace_path(args.trace_dir, kind),
        values.get("start_min", args.start_min),
        args.minutes,
        values.get("time_scale", 1.0),
        tokens,
    )


def setup_from(args: argparse.Namespace) -> Any:
    from vllm_kv_cache_limit.sim.instance import InstanceSpec
    from vllm_kv_cache_limit.sim.scenarios import SCENARIOS, Setup

    try:
        budget = parse_size(args.budget)
    except ValueError as exc:
        raise UsageError(f"--budget {args.budget!r}: {exc}") from None
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if names == ["all"]:
        names = list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise UsageError(f"--scenarios {args.scenarios!r}: choose from {', '.join(SCENARIOS)}, e.g. even,autoscale")
    parsed = [parse_instance(text) for text in args.instance]
    device_bytes = _device_memory(args, parsed)
    if device_bytes is None and args.scenarios == "all":
        names.remove("no-cap")  # vLLM's own sizing needs the device's memory
    if not 0.0 <= args.overlap <= 1.0:
        raise UsageError(f"--overlap {args.overlap!r}: give a fraction from 0 (time-sharing) to 1, e.g. --overlap 0.5")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise UsageError(f"--gpu-memory-utilization {args.gpu_memory_utilization!r}: give one in (0, 1], e.g. 0.9")
    specs, floors = [], []
    for index, values in enumerate(parsed):
        name = values.get("name", f"i{index}")
        specs.append(
            InstanceSpec(
                name, values["model"], values["max_model_len"], values.get("block_size", 16),
                values.get("max_num_seqs", 256),
            )
        )  # fmt: skip
        floors.append(None if "floor" not in values else parse_size(values["floor"]))
    if len({s.name for s in specs}) != len(specs):
        raise UsageError(f"--instance names {[s.name for s in specs]} repeat; give each a name=.")
    setup = Setup(
        specs=specs,
        traffic=[_traffic(v, args) for v in parsed],
        step_times=[_step_time(v, args) for v in parsed],
        budget_bytes=budget,
        floors=floors,
        shrink_after_s=args.shrink_after,
        slo=metrics.SLO(args.slo_ttft, args.slo_tpot),
        drain_s=args.drain,
        verbose=args.verbose,
        device_bytes=device_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        overlap=args.overlap,
    )
    if device_bytes is not None:
        from vllm_kv_cache_limit.sim.memory import footprint

        setup.footprints = [
            footprint(spec, *(_size(v, key) for key in ("weights", "activations"))) for spec, v in zip(specs, parsed)
        ]
    return setup, names


def _size(values: dict[str, Any], key: str) -> int | None:
    if key not in values:
        return None
    try:
        return parse_size(values[key])
    except ValueError as exc:
        raise UsageError(f"--instance ...,{key}={values[key]!r}: {exc}") from None


def _device_memory(args: argparse.Namespace, parsed: list[dict[str, Any]]) -> int | None:
    """--device-memory, else --system's total where aiconfigurator-core times an instance, else None (unchecked)."""
    from vllm_kv_cache_limit.sim.memory import DEVICE_MEMORY

    if args.device_memory is not None:
        try:
            return parse_size(args.device_memory)
        except ValueError as exc:
            raise UsageError(f"--device-memory {args.device_memory!r}: {exc}") from None
    if any("aiconfigurator" in v for v in parsed):
        if args.system not in DEVICE_MEMORY:
            raise UsageError(
                f"--system {args.system!r} has no known memory; give --device-memory, e.g. --device-memory 80GiB "
                f"(known: {', '.join(DEVICE_MEMORY)})"
            )
        return DEVICE_MEMORY[args.system]
    return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def report(results: list[dict[str, Any]], setup: Any) -> str:
    lines = [
        f"shared KV cache budget {format_size(setup.budget_bytes)}; SLO TTFT <= {setup.slo.ttft_s:g} s, "
        f"TPOT <= {setup.slo.tpot_s:g} s",
        "",
        f"{'scenario':<10} {'instance':<10} {'reqs':>5} {'done':>5} {'TTFT p50/p90/p99 ms':>22} "
        f"{'TPOT p50/p90 ms':>16} {'E2E p50/p90 s':>14} {'SLO':>5} {'goodput/s':>9} {'preempt':>7} {'changes':>7}",
    ]
    for result in results:
        for name, f in result["instances"].items():
            if f.get("error"):
                lines.append(
                    f"{result['scenario']:<10} {name:<10} {f['requests']:>5} {0:>5}  did not start: {f['error']}"
                )
                continue
            t, p, e = f["ttft_s"], f["tpot_s"], f["e2e_s"]
            e2e = "-" if e["p50"] is None else f"{e['p50']:.1f}/{e['p90']:.1f}"
            slo = "-" if f["slo_attainment"] is None else f"{f['slo_attainment']:.0%}"
            lines.append(
                f"{result['scenario']:<10} {name:<10} {f['requests']:>5} {f['finished']:>5} "
                f"{_ms(t['p50']) + '/' + _ms(t['p90']) + '/' + _ms(t['p99']):>22} "
                f"{_ms(p['p50']) + '/' + _ms(p['p90']):>16} {e2e:>14} {slo:>5} {f['goodput_req_s']:>9.2f} "
                f"{f['preemptions']:>7} {'-' if f['limit_changes'] is None else f['limit_changes']:>7}"
            )
        lines.append(f"{result['scenario']:<10} {'(all)':<10} goodput {result['goodput_req_s']:.2f} req/s, "
                     f"device busy {result['device_busy']:.0%}")  # fmt: skip
    return "\n".join(lines)


def _run_all(names: list[str], setup: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from vllm_kv_cache_limit.sim.plot import plot_path, progress_bar, write_timeline
    from vllm_kv_cache_limit.sim.scenarios import run

    total = max((a.at for t in setup.traffic for a in t), default=0.0)
    setup.waiting_blocks = bool(args.plot)
    results = []
    for name in names:
        setup.progress, close = progress_bar(name, total, args.progress)
        try:
            result = run(name, setup)
        finally:
            close()
        if args.plot and write_timeline(result, plot_path(args.plot, name)) is None:
            print(f"vllm-kv-sim: scenario {name}: no instance started, no plot", file=sys.stderr)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        return _calibrate(argv[1:])
    args = parser().parse_args(argv)
    from vllm_kv_cache_limit.plan.introspect import quiet_vllm

    try:
        with quiet_vllm(args.verbose):  # vLLM logs to stdout: its lines would break --json and drown the table
            setup, names = setup_from(args)
            from vllm_kv_cache_limit.sim.instance import SimulationError
            from vllm_kv_cache_limit.sim.plot import PlotError

            try:
                results = _run_all(names, setup, args)
                recommended = None
                if args.recommend:
                    from vllm_kv_cache_limit.sim.recommend import recommend

                    recommended = recommend(setup)
            except (SimulationError, KVCacheMaxMemoryError, PlotError) as exc:
                raise UsageError(str(exc)) from None
    except (UsageError, StepTimeError, traffic.TrafficError, ValueError) as exc:
        print(f"vllm-kv-sim: error: {exc}", file=sys.stderr)
        return 2
    for result in results:
        for key in ("timelines", "limits", "records"):
            result.pop(key, None)
    if args.json:
        out: dict[str, Any] = {"budget_bytes": setup.budget_bytes, "scenarios": results}
        if recommended is not None:
            out["recommendation"] = recommended
        print(json.dumps(out, indent=2))
    else:
        print(report(results, setup))
        if recommended is not None:
            from vllm_kv_cache_limit.sim.recommend import format_recommendation

            print()
            print(format_recommendation(recommended))
    return 0


CALIBRATE = "vllm_kv_cache_limit.sim.calibrate"


def _calibrate(argv: list[str]) -> int:
    """``vllm-kv-sim calibrate ...``: the calibration command (``sim/calibrate.py``'s ``main``)."""
    try:
        module = importlib.import_module(CALIBRATE)
    except ModuleNotFoundError as exc:
        if exc.name != CALIBRATE:
            raise
        print(f"vllm-kv-sim: error: calibrate is not in this version of the simulator ({CALIBRATE} is missing); "
              "run the simulation itself: vllm-kv-sim --instance ... --budget SIZE", file=sys.stderr)  # fmt: skip
        return 2
    return int(module.main(argv))
