"""Benchmark 3b, engine overhead: start-up time and generation throughput at
the same block count, plugin loaded vs excluded through ``VLLM_PLUGINS``.

    .venv/bin/python benchmarks/bench_engine_overhead.py [--device cpu|cuda] [--model PATH]
        [--blocks 160] [--pairs 2] [--repeats 5] [--with-override-variant]

Variants, alternating in ABBA order:
  cap       plugin active, ``kv_cache_max_memory`` = BLOCKS whole blocks
  excluded  plugin excluded, ``num_gpu_blocks_override`` = BLOCKS
  override  (with --with-override-variant) plugin active, no cap,
            ``num_gpu_blocks_override`` = BLOCKS: only the hooks differ
Start-up is the time ``LLM(...)`` takes in the process (engine core, worker,
weights, KV cache); throughput is output tokens/s of a fixed workload that
needs no preemption at BLOCKS blocks (median of ``--repeats`` timed runs per
engine after a warm-up). Target: ratios within 0.98-1.02 (noise). The
worker also records, in the first process, the seconds spent in
``EngineArgs.create_engine_config`` (where the plugin checks a cap, before
the engine-core process starts) and the full garbage collections during
``LLM(...)``.

It then times, in fresh interpreters, the work the plugin adds to the first
process's start-up when a cap is set, in the order ``create_engine_config``
runs it: reading the device's total memory, then
``compat.check_hooks_at_startup()`` (hooks in modules already imported are
checked on the live objects, the worker modules in vLLM's source with
``ast``), and lists the modules that work imports. For reference it also
times ``compat.check_hooks()``, the full check that imports every hooked
module (the worker modules included), which is what start-up ran before
it switched to the cheaper check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import _common as c

# Runs in a fresh interpreter that has imported what a user's process has
# (``from vllm import LLM``): times the work the plugin adds to the first
# process's start-up when a cap is set (the device's total memory, then the
# start-up hook check) and lists the modules that work imports; then, for
# reference, the full hook check that imports every hooked module.
ATTRIBUTION = r"""
import json, sys, time
from vllm import LLM
from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.hooks import devices
before = set(sys.modules)
t0 = time.perf_counter(); devices.device_total_memory(); total = time.perf_counter() - t0
t0 = time.perf_counter(); problems = compat.check_hooks_at_startup()
first = time.perf_counter() - t0
added = sorted(set(sys.modules) - before)
t0 = time.perf_counter(); compat.check_hooks_at_startup(); again = time.perf_counter() - t0
before_full = set(sys.modules)
t0 = time.perf_counter(); full_problems = compat.check_hooks(); full = time.perf_counter() - t0
full_added = sorted(set(sys.modules) - before_full)
print("ATTR " + json.dumps({"check_hooks_first_s": first, "check_hooks_again_s": again,
    "device_total_memory_s": total, "problems": problems, "modules_added": added,
    "full_check_hooks_s": full, "full_problems": full_problems,
    "full_check_modules_added": full_added}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    c.add_common_args(parser)
    parser.add_argument("--blocks", type=int, default=160)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--with-override-variant", action="store_true")
    parser.add_argument("--attribution-runs", type=int, default=3)
    args = parser.parse_args()

    model = c.model_path(args)
    block_bytes = c.block_bytes_estimate(args, model)
    max_model_len = args.prompt_len + args.output_len
    common = dict(
        max_model_len=max_model_len,
        disable_log_stats=False,
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=max(args.num_prompts * args.prompt_len, max_model_len),
        workload={
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
        },
    )
    variants = {
        "cap": (dict(kv_cache_max_memory=args.blocks * block_bytes), c.bench_env(plugin=True)),
        "excluded": (dict(num_gpu_blocks_override=args.blocks), c.bench_env(plugin=False)),
    }
    if args.with_override_variant:
        variants["override"] = (dict(num_gpu_blocks_override=args.blocks), c.bench_env(plugin=True))
    names = list(variants)
    rows = []
    for pair in range(args.pairs):
        order = names if pair % 2 == 0 else names[::-1]
        for name in order:
            extra, env = variants[name]
            spec = c.base_engine_args(args, **common, **extra)
            run = c.run_engine(spec, env, log_name=f"engine-overhead-{name}-{pair}")
            c.check_ok(run, f"variant {name}")
            res = run.result
            runs = res["workload"]["runs"]
            rows.append(
                {
                    "pair": pair,
                    "variant": name,
                    "plugin_loaded": name != "excluded",
                    "blocks": res["num_gpu_blocks"],
                    "kv_bytes": res["kv_cache_bytes"][0],
                    "plugin_log_line": "KV cache max memory:" in run.log,
                    "startup_s": res["startup_s"],
                    "ready_after_launch_s": res["ready_after_launch_s"],
                    "tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
                    "tokens_per_s_runs": [r["output_tokens_per_s"] for r in runs],
                    "startup_cpu_s": res["startup_cpu_s"],
                    "tokens_per_cpu_s": statistics.median(r["output_tokens_per_cpu_s"] for r in runs),
                    "preemptions": sum(r["preemptions"] or 0 for r in runs),
                    "create_engine_config_s": res.get("create_engine_config_s"),
                    "parent_full_gc_count": res.get("parent_full_gc_count"),
                    "parent_full_gc_s": res.get("parent_full_gc_s"),
                    "parent_modules": res.get("parent_modules"),
                    "parent_worker_modules": res.get("parent_worker_modules"),
                }
            )
            print(
                f"pair {pair} {name}: {rows[-1]['blocks']} blocks, start-up "
                f"{rows[-1]['startup_s']:.1f} s, {rows[-1]['tokens_per_s']:.0f} tok/s",
                flush=True,
            )

    attribution = []
    for _ in range(args.attribution_runs):
        proc = subprocess.run(
            [sys.executable, "-c", ATTRIBUTION], env=c.bench_env(), capture_output=True, text=True, cwd=c.REPO
        )
        line = next((line for line in proc.stdout.splitlines() if line.startswith("ATTR ")), None)
        if line:
            attribution.append(json.loads(line[5:]))
    blocks = {r["blocks"] for r in rows}
    summary: dict = {"blocks": sorted(blocks), "same_block_count": len(blocks) == 1, "ratios": {}}
    for name in names:
        if name == "excluded":
            continue
        ratios = {}
        for key in (
            "startup_s",
            "ready_after_launch_s",
            "tokens_per_s",
            "startup_cpu_s",
            "tokens_per_cpu_s",
            "create_engine_config_s",
        ):
            mine = [r[key] for r in rows if r["variant"] == name]
            base = [r[key] for r in rows if r["variant"] == "excluded"]
            per_pair = [m / b for m, b in zip(mine, base)]
            ratios[key] = {
                "ratio_of_medians": statistics.median(mine) / statistics.median(base),
                "per_pair": per_pair,
                "within_2pct": abs(statistics.median(mine) / statistics.median(base) - 1) <= 0.02,
            }
        summary["ratios"][name] = ratios
    # Run-to-run spread of the same variant: what "noise" means here.
    noise = {}
    for key in ("startup_s", "tokens_per_s", "startup_cpu_s", "tokens_per_cpu_s"):
        spreads = []
        for name in names:
            vals = [r[key] for r in rows if r["variant"] == name]
            if len(vals) >= 2:
                spreads.append(max(vals) / min(vals) - 1)
        noise[key] = max(spreads) if spreads else None
    summary["same_variant_spread"] = noise
    if attribution:
        added = attribution[-1]["modules_added"]
        summary["startup_attribution"] = {
            "check_hooks_first_s": c.spread([a["check_hooks_first_s"] for a in attribution]),
            "check_hooks_again_s": c.spread([a["check_hooks_again_s"] for a in attribution]),
            "device_total_memory_s": c.spread([a["device_total_memory_s"] for a in attribution]),
            "modules_added_count": len(added),
            "modules_added_top": sorted({m for m in added if m.count(".") <= 3})[:40],
            "problems": attribution[-1]["problems"],
            "full_check_hooks_s": c.spread([a["full_check_hooks_s"] for a in attribution]),
            "full_check_modules_added_count": len(attribution[-1]["full_check_modules_added"]),
        }

    c.print_table(
        rows,
        [
            *c.PAIR_COLUMNS,
            ("blocks", "blocks"),
            ("plugin_log_line", "plugin INFO line"),
            ("startup_s", "LLM() start-up s"),
            ("ready_after_launch_s", "launch->ready s"),
            ("startup_cpu_s", "start-up CPU s"),
            ("tokens_per_s", "output tok/s"),
            ("tokens_per_cpu_s", "output tok/CPU s"),
            ("preemptions", "preemptions"),
        ],
        digits=2,
    )
    c.print_table(
        rows,
        [
            *c.PAIR_COLUMNS,
            ("create_engine_config_s", "first process: create_engine_config s"),
            ("parent_full_gc_count", "full GCs in LLM()"),
            ("parent_full_gc_s", "full GC s"),
            ("parent_modules", "modules after LLM()"),
        ],
        digits=3,
    )
    print()
    for name, ratios in summary["ratios"].items():
        print(
            f"{name} / excluded (ratio of medians): start-up "
            f"{ratios['startup_s']['ratio_of_medians']:.3f}, launch->ready "
            f"{ratios['ready_after_launch_s']['ratio_of_medians']:.3f}, start-up CPU "
            f"{ratios['startup_cpu_s']['ratio_of_medians']:.3f}, throughput "
            f"{ratios['tokens_per_s']['ratio_of_medians']:.3f}, tokens per CPU second "
            f"{ratios['tokens_per_cpu_s']['ratio_of_medians']:.3f}"
        )
    print(
        "same-variant spread (max/min - 1): "
        + ", ".join(f"{k} {c.fmt(v)}" for k, v in noise.items())
        + f"; same block count: {summary['same_block_count']}"
    )
    attr = summary.get("startup_attribution")
    if attr:
        print(
            f"first process, cap set: device total memory "
            f"{attr['device_total_memory_s']['median'] * 1e3:.2f} ms, then "
            f"compat.check_hooks_at_startup() first call "
            f"{attr['check_hooks_first_s']['median'] * 1e3:.1f} ms (together they import "
            f"{attr['modules_added_count']} modules; problems: {attr['problems']}), again "
            f"{attr['check_hooks_again_s']['median'] * 1e3:.2f} ms"
        )
        print(f"  modules they import (top levels): {attr['modules_added_top']}")
        print(
            f"  for reference, the full compat.check_hooks() after it: "
            f"{attr['full_check_hooks_s']['median']:.2f} s (imports "
            f"{attr['full_check_modules_added_count']} more modules)"
        )
    for name in names:
        mods = {tuple(r.get("parent_worker_modules") or ()) for r in rows if r["variant"] == name}
        print(f"{name}: vllm.v1.worker modules in the first process: {sorted(mods)}")
    csv_path, _ = c.save("engine_overhead", rows, {"summary": summary})
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()
