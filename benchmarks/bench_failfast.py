"""Benchmark 4, fail-fast: time from launch to error for a cap larger than
the device, against vLLM's own ``kv_cache_memory_bytes`` with the same value
(which vLLM checks only in the worker, after the weights have loaded).

    .venv/bin/python benchmarks/bench_failfast.py [--device cpu|cuda] [--model PATH]
        [--size 100G] [--pairs 2]

The two variants alternate. "plugin" runs ``kv_cache_max_memory=SIZE`` with
the plugin active; "vllm" runs ``kv_cache_memory_bytes=SIZE`` with the
plugin excluded through ``VLLM_PLUGINS``. Each log is searched for the
engine-core process, the worker process and vLLM's model-loading lines, to
show where each variant stopped.
"""

from __future__ import annotations

import argparse
import re
import statistics

import _common as c

ROOT_CAUSE = re.compile(r"(?:ValueError|KVCacheMaxMemoryError): (.+)")
MARKERS = {
    "engine_core_started": "Initializing a V1 LLM engine",
    "model_load_started": "Starting to load model",
    "weights_loaded": "Loading weights took",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--size", default="100G")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()

    from vllm_kv_cache_limit.logic.sizes import parse_size

    size = parse_size(args.size)
    variants = {
        "plugin": (dict(kv_cache_max_memory=size), c.bench_env(plugin=True)),
        "vllm": (dict(kv_cache_memory_bytes=size), c.bench_env(plugin=False)),
    }
    rows = []
    for pair in range(args.pairs):
        order = ["plugin", "vllm"] if pair % 2 == 0 else ["vllm", "plugin"]
        for name in order:
            extra, env = variants[name]
            spec = c.base_engine_args(args, max_model_len=512, **extra)
            run = c.run_engine(spec, env, log_name=f"failfast-{name}-{pair}")
            res = run.result
            row = {
                "pair": pair,
                "variant": name,
                "argument": next(iter(extra)) + f"={args.size}",
                "failed": not res.get("ok"),
                "error_after_launch_s": res.get("error_after_launch_s"),
                "error_in_llm_s": res.get("error_in_llm_s"),
                "import_s": res.get("import_s"),
                "process_wall_s": run.wall_s,
                "error_type": res.get("error_type"),
                "error": (res.get("error") or "")[:300],
                "root_cause": root_cause(run.log) or res.get("error"),
            }
            row.update({k: run.has_log(v) for k, v in MARKERS.items()})
            rows.append(row)
            print(
                f"{name}: error after {fmt_s(row['error_after_launch_s'])} "
                f"({row['error_type']}), weights loaded: {row['weights_loaded']}",
                flush=True,
            )

    c.print_table(
        rows,
        [
            *c.PAIR_COLUMNS,
            ("argument", "argument"),
            ("error_after_launch_s", "launch->error s"),
            ("import_s", "import vllm s"),
            ("error_in_llm_s", "LLM()->error s"),
            ("process_wall_s", "process exit s"),
            ("engine_core_started", "engine core"),
            ("model_load_started", "model load"),
            ("weights_loaded", "weights loaded"),
            ("error_type", "error"),
        ],
        digits=2,
    )
    med, med_llm = {}, {}
    for name in variants:
        times = [
            r["error_after_launch_s"] for r in rows if r["variant"] == name and r["error_after_launch_s"] is not None
        ]
        med[name] = statistics.median(times) if times else None
        times = [r["error_in_llm_s"] for r in rows if r["variant"] == name and r["error_in_llm_s"] is not None]
        med_llm[name] = statistics.median(times) if times else None
    for name in variants:
        cause = next((r["root_cause"] for r in rows if r["variant"] == name), None)
        print(f"{name} root cause: {cause}")
    summary = {
        "median_error_after_launch_s": med,
        "median_error_in_llm_s": med_llm,
        "ratio_plugin_over_vllm": (med["plugin"] / med["vllm"] if med["plugin"] and med["vllm"] else None),
        "plugin_stops_before_weights": all(
            r["failed"] and not r["weights_loaded"] and not r["model_load_started"]
            for r in rows
            if r["variant"] == "plugin"
        ),
        "all_failed": all(r["failed"] for r in rows),
    }
    csv_path, _ = c.save("failfast", rows, {"summary": summary})
    print(
        f"\nmedian launch->error: plugin {fmt_s(med['plugin'])}, vLLM {fmt_s(med['vllm'])}; "
        f"inside LLM(): plugin {fmt_s(med_llm['plugin'])}, vLLM {fmt_s(med_llm['vllm'])}; "
        f"ratio {c.fmt(summary['ratio_plugin_over_vllm'])}; plugin stops before "
        f"weights load: {summary['plugin_stops_before_weights']}\nwrote {csv_path}"
    )


def root_cause(log: str) -> str | None:
    """The first ValueError / KVCacheMaxMemoryError message in the log."""
    match = ROOT_CAUSE.search(log)
    return match.group(1).strip()[:400] if match else None


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    main()
