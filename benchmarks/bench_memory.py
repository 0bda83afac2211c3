"""Benchmark 2, memory released: the worker's resident memory (CPU backend)
or device memory in use (CUDA) with no cap and with caps, against what the
cap should free, vLLM's automatic KV budget minus the cap.

    .venv/bin/python benchmarks/bench_memory.py [--device cpu|cuda] [--model PATH]
        [--caps 512M 256M 64M] [--cycles 1]

vLLM's automatic budget comes from the no-cap engine: the bytes it allocates
(its budget rounded down to whole blocks) and its log line "Auto set (X/Y)
GiB for KV cache" (CPU) / "Available KV cache memory" (CUDA). Each capped
engine logs its own budget in the plugin's INFO line ("vLLM budget X GiB").
The worker also reports how many bytes of the KV buffer are resident
(``mincore``), which shows whether the allocation touched its pages.
Target: the drop in resident memory matches (budget - cap) within 5%.
"""

from __future__ import annotations

import argparse
import re

import _common as c

DEFAULT_CAPS = ["512M", "256M", "64M"]
AUTO_SET = re.compile(r"Auto set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
CUDA_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
PLUGIN_BUDGET = re.compile(r"vLLM budget (?:\d+ bytes \()?([\d.]+) GiB")


def memory_in_use(worker: dict, device: str) -> int:
    return worker["device_used_bytes"] if device == "cuda" else worker["rss_bytes"]


def logged_budget_gib(log: str) -> float | None:
    for pattern in (PLUGIN_BUDGET, AUTO_SET, CUDA_AVAILABLE):
        match = pattern.search(log)
        if match:
            return float(match.group(1))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--caps", nargs="+", default=DEFAULT_CAPS)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--cycles", type=int, default=1, help="repeat no-cap + caps this many times (default 1)")
    args = parser.parse_args()

    from vllm_kv_cache_limit.logic.sizes import parse_size

    variants = [("none", None)] + [(text, parse_size(text)) for text in args.caps]
    raw = []
    for cycle in range(args.cycles):
        for text, cap in variants:
            extra = {"max_model_len": args.max_model_len}
            if cap is not None:
                extra["kv_cache_max_memory"] = cap
            spec = c.base_engine_args(args, **extra)
            run = c.run_engine(spec, c.bench_env(), log_name=f"memory-{text}-{cycle}")
            c.check_ok(run, f"engine with cap {text}")
            worker = run.result["workers"][0]
            in_use = memory_in_use(worker, args.device)
            print(
                f"cycle {cycle} cap {text}: KV {c.mib(worker['kv_cache_bytes']):.1f} MiB, in use {c.mib(in_use):.1f} MiB",
                flush=True,
            )
            raw.append(
                {
                    "cycle": cycle,
                    "cap": text,
                    "cap_bytes": cap,
                    "kv_bytes": worker["kv_cache_bytes"],
                    "kv_resident_bytes": worker.get("kv_resident_bytes"),
                    "in_use_bytes": in_use,
                    "tree_rss_bytes": run.result.get("tree_rss_bytes"),
                    "budget_gib_logged": logged_budget_gib(run.log),
                }
            )

    rows = []
    for cycle in range(args.cycles):
        base = next(r for r in raw if r["cycle"] == cycle and r["cap_bytes"] is None)
        budget = base["kv_bytes"]  # the automatic budget, whole blocks
        for r in raw:
            if r["cycle"] != cycle:
                continue
            row = dict(r)
            row["kv_mib"] = c.mib(r["kv_bytes"])
            row["kv_resident_mib"] = c.mib(r["kv_resident_bytes"])
            row["in_use_mib"] = c.mib(r["in_use_bytes"])
            row["non_kv_mib"] = c.mib(r["in_use_bytes"] - r["kv_bytes"])
            row["budget_mib"] = c.mib(budget)
            if r["cap_bytes"] is not None:
                expected = budget - min(r["cap_bytes"], budget)
                drop = base["in_use_bytes"] - r["in_use_bytes"]
                row["expected_drop_mib"] = c.mib(expected)
                row["drop_mib"] = c.mib(drop)
                row["drop_ratio"] = drop / expected if expected else None
                row["tree_drop_ratio"] = (base["tree_rss_bytes"] - r["tree_rss_bytes"]) / expected if expected else None
                row["within_5pct"] = abs(drop / expected - 1) <= 0.05 if expected else None
            rows.append(row)

    c.print_table(
        rows,
        [
            ("cycle", "cycle"),
            ("cap", "cap"),
            ("budget_gib_logged", "budget GiB (log)"),
            ("kv_mib", "KV MiB"),
            ("kv_resident_mib", "KV resident MiB"),
            ("in_use_mib", "worker RSS MiB" if args.device == "cpu" else "device used MiB"),
            ("non_kv_mib", "in use - KV MiB"),
            ("expected_drop_mib", "budget-cap MiB"),
            ("drop_mib", "drop MiB"),
            ("drop_ratio", "drop/(budget-cap)"),
            ("tree_drop_ratio", "all procs drop ratio"),
            ("within_5pct", "within 5%"),
        ],
    )
    checked = [r["within_5pct"] for r in rows if r.get("within_5pct") is not None]
    touched = [
        r["kv_resident_bytes"] / r["kv_bytes"] for r in raw if r.get("kv_resident_bytes") is not None and r["kv_bytes"]
    ]
    summary = {
        "target_met": bool(checked) and all(checked),
        "kv_resident_fraction_min": min(touched) if touched else None,
        "measure": "worker RSS" if args.device == "cpu" else "device memory in use",
    }
    csv_path, _ = c.save("memory", rows, {"summary": summary})
    print(
        f"\ndrop within 5% of (budget - cap) for every cap: {summary['target_met']}; "
        f"smallest resident fraction of the KV buffer: {summary['kv_resident_fraction_min']}"
        f"\nwrote {csv_path}"
    )


if __name__ == "__main__":
    main()
