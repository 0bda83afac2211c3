"""Benchmark 3a, import overhead: ``import vllm`` and ``from vllm import LLM``
in fresh interpreters with the plugin active vs excluded through
``VLLM_PLUGINS`` (paired, alternating), plus where the plugin's own time goes.

    .venv/bin/python benchmarks/bench_import.py [--pairs 20] [--llm-pairs 6]
        [--attribution-runs 3]

Each pair runs both variants back to back, in alternating order (ABBA), and
the overhead is the median of the per-pair differences (active - excluded)
with its quartiles. Times are wall-clock from process launch to exit, so they
include the interpreter start-up, where the plugin's ``.pth`` hook runs.

The attribution measures the plugin directly, with far less noise:
``python -X importtime`` for the start-up hook (``vllm_kv_cache_limit.pth``
imports ``vllm_kv_cache_limit._bootstrap`` in every interpreter of the
environment, also when ``VLLM_PLUGINS`` excludes the plugin), the time spent
in the post-import hooks during ``from vllm import LLM`` and the import of
the worker module, and the modules the plugin adds to ``sys.modules``.
Target: import overhead under 20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common as c

TIMED = "import time as _t; _s = _t.perf_counter(); {stmt}; print('IMPORT_S', _t.perf_counter() - _s)"

# Runs in a fresh interpreter with the plugin active: times every hook the
# plugin runs while vLLM imports, and lists the modules loaded.
ATTRIBUTION = r"""
import json, sys, time
import vllm_kv_cache_limit._bootstrap as boot
spent = {}
original = boot._run_hook
def timed(module):
    start = time.perf_counter()
    try:
        original(module)
    finally:
        spent[module.__name__] = spent.get(module.__name__, 0.0) + time.perf_counter() - start
boot._run_hook = timed
start = time.perf_counter()
from vllm import LLM
llm_s = time.perf_counter() - start
import importlib
importlib.import_module(WORKER_MODULE)
print("ATTR " + json.dumps({"hooks_s": spent, "llm_import_s": llm_s,
                            "modules": sorted(sys.modules)}))
"""

MODULES = r"""
import json, sys, importlib
from vllm import LLM
importlib.import_module(WORKER_MODULE)
print("ATTR " + json.dumps({"modules": sorted(sys.modules)}))
"""


def timed_import(stmt: str, plugin: bool) -> dict[str, float]:
    """Wall seconds from launch to exit, CPU seconds (user + system) of the
    child, and seconds of the import statement itself."""
    env = c.bench_env(plugin=plugin)
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", TIMED.format(stmt=stmt)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=c.REPO,
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{stmt!r} failed (exit {proc.returncode})")
    inner = float(next(line for line in out.splitlines() if line.startswith("IMPORT_S")).split()[1])
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "inner": inner}


def paired(stmt: str, pairs: int) -> tuple[list[dict], dict]:
    rows = []
    for pair in range(pairs):
        order = [True, False] if pair % 2 == 0 else [False, True]
        times = {plugin: timed_import(stmt, plugin) for plugin in order}
        row = {"statement": stmt, "pair": pair, "first": "active" if order[0] else "excluded"}
        for kind in ("wall", "cpu", "inner"):
            row[f"active_{kind}_s"] = times[True][kind]
            row[f"excluded_{kind}_s"] = times[False][kind]
            row[f"diff_{kind}_ms"] = (times[True][kind] - times[False][kind]) * 1e3
        rows.append(row)
        print(
            f"{stmt!r} pair {pair}: wall active {times[True]['wall']:.3f} s, excluded "
            f"{times[False]['wall']:.3f} s; cpu active {times[True]['cpu']:.3f} s, "
            f"excluded {times[False]['cpu']:.3f} s",
            flush=True,
        )
    summary: dict = {"statement": stmt, "pairs": pairs}
    for kind in ("wall", "cpu", "inner"):
        for key in (f"active_{kind}_s", f"excluded_{kind}_s", f"diff_{kind}_ms"):
            summary[key] = c.spread([r[key] for r in rows])
        summary[f"ratio_{kind}_medians"] = (
            summary[f"active_{kind}_s"]["median"] / summary[f"excluded_{kind}_s"]["median"]
        )
    return rows, summary


def parse_importtime(stderr: str, root: str) -> dict[str, int]:
    """Self microseconds of ``root`` and of every module imported under it,
    from ``-X importtime`` output (children are printed before their parent,
    indented deeper)."""
    entries = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        parts = line.split("|")
        self_us = int(parts[0].split(":")[1])
        label = parts[2]
        indent = len(label) - len(label.lstrip())
        entries.append((label.strip(), self_us, indent))
    idx = next(i for i, e in enumerate(entries) if e[0] == root)
    root_indent = entries[idx][2]
    found = {root: entries[idx][1]}
    for name, self_us, indent in reversed(entries[:idx]):
        if indent <= root_indent:
            break
        found[name] = found.get(name, 0) + self_us
    return found


def bootstrap_import(runs: int) -> dict:
    """``-X importtime`` of the start-up hook in a bare interpreter: the
    cumulative microseconds and each module's self microseconds."""
    totals, per_module = [], []
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "pass"],
            env=c.bench_env(),
            capture_output=True,
            text=True,
            cwd=c.REPO,
        )
        modules = parse_importtime(proc.stderr, "vllm_kv_cache_limit._bootstrap")
        per_module.append(modules)
        totals.append(sum(modules.values()))
    names = sorted({n for m in per_module for n in m})
    return {
        "cumulative_us": c.spread(totals),
        "self_us": {n: statistics.median(m.get(n, 0) for m in per_module) for n in names},
    }


def attribution(runs: int, worker_module: str) -> dict:
    hooks, llm_import = [], []
    modules_active: set[str] = set()
    for _ in range(runs):
        code = ATTRIBUTION.replace("WORKER_MODULE", repr(worker_module))
        proc = subprocess.run(
            [sys.executable, "-c", code], env=c.bench_env(), capture_output=True, text=True, cwd=c.REPO, check=True
        )
        data = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ATTR "))[5:])
        hooks.append(data["hooks_s"])
        llm_import.append(data["llm_import_s"])
        modules_active = set(data["modules"])
    code = MODULES.replace("WORKER_MODULE", repr(worker_module))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=c.bench_env(plugin=False),
        capture_output=True,
        text=True,
        cwd=c.REPO,
        check=True,
    )
    modules_excluded = set(
        json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("ATTR "))[5:])["modules"]
    )
    per_hook = {
        name: c.spread([h.get(name, 0.0) * 1e3 for h in hooks]) for name in sorted({n for h in hooks for n in h})
    }
    return {
        "runs": runs,
        "hook_ms_total": c.spread([sum(h.values()) * 1e3 for h in hooks]),
        "hook_ms": per_hook,
        "from_vllm_import_llm_s": c.spread(llm_import),
        "extra_modules_with_plugin": sorted(modules_active - modules_excluded),
        "modules_excluded": sorted(modules_excluded),
        "modules_missing_with_plugin": sorted(modules_excluded - modules_active),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(c.DEVICE_DEFAULTS), default="cpu")
    parser.add_argument("--pairs", type=int, default=20, help="pairs for `import vllm` (default 20)")
    parser.add_argument(
        "--llm-pairs", type=int, default=6, help="pairs for `from vllm import LLM` (default 6; 20 takes ~7 min)"
    )
    parser.add_argument("--attribution-runs", type=int, default=3)
    args = parser.parse_args()

    worker_module = "vllm.v1.worker.cpu_worker" if args.device == "cpu" else "vllm.v1.worker.gpu_worker"
    rows, summaries = [], []
    for stmt, pairs in (("import vllm", args.pairs), ("from vllm import LLM", args.llm_pairs)):
        if pairs <= 0:
            continue
        r, s = paired(stmt, pairs)
        rows += r
        summaries.append(s)
    boot = bootstrap_import(5)
    attr = attribution(args.attribution_runs, worker_module)

    table_rows = []
    for s in summaries:
        for kind, label in (("wall", "wall, launch to exit"), ("cpu", "CPU user+sys")):
            a, e, d = s[f"active_{kind}_s"], s[f"excluded_{kind}_s"], s[f"diff_{kind}_ms"]
            table_rows.append(
                {
                    "statement": s["statement"],
                    "measure": label,
                    "pairs": s["pairs"],
                    "active": a["median"],
                    "spread_active": f"{a['q1']:.3f}-{a['q3']:.3f}",
                    "excluded": e["median"],
                    "spread_excluded": f"{e['q1']:.3f}-{e['q3']:.3f}",
                    "diff_ms": d["median"],
                    "diff_iqr": f"{d['q1']:.0f} to {d['q3']:.0f}",
                    "ratio": s[f"ratio_{kind}_medians"],
                }
            )
    c.print_table(
        table_rows,
        [
            ("statement", "statement"),
            ("measure", "measure"),
            ("pairs", "pairs"),
            ("active", "active median s"),
            ("spread_active", "active IQR s"),
            ("excluded", "excluded median s"),
            ("spread_excluded", "excluded IQR s"),
            ("diff_ms", "paired diff median ms"),
            ("diff_iqr", "paired diff IQR ms"),
            ("ratio", "ratio of medians"),
        ],
    )
    # Start-up hook: in a bare interpreter everything under it counts; in a
    # vLLM process only the modules vLLM would not import anyway.
    vllm_modules = set(attr.pop("modules_excluded"))
    own = sum(us for n, us in boot["self_us"].items() if n.startswith("vllm_kv_cache_limit"))
    # (The excluded variant still runs the start-up hook, so the plugin's own
    # modules are in its list; they count in full.)
    marginal = sum(
        us for n, us in boot["self_us"].items() if n not in vllm_modules or n.startswith("vllm_kv_cache_limit")
    )
    hooks_ms = attr["hook_ms_total"]["median"]
    print(
        f"\nstart-up hook (-X importtime, bare interpreter): cumulative median "
        f"{boot['cumulative_us']['median'] / 1e3:.1f} ms (min "
        f"{boot['cumulative_us']['min'] / 1e3:.1f}), of which the plugin's own modules "
        f"{own / 1e3:.1f} ms; with the modules vLLM does not import itself: "
        f"{marginal / 1e3:.1f} ms"
    )
    print(f"post-import hooks during `from vllm import LLM` + {worker_module}: median {hooks_ms:.1f} ms in all")
    for name, s in attr["hook_ms"].items():
        print(f"  {name}: {s['median']:.2f} ms")
    print(f"modules added by the plugin in a vLLM process: {attr['extra_modules_with_plugin']}")
    if attr["modules_missing_with_plugin"]:
        print(f"modules only loaded without the plugin: {attr['modules_missing_with_plugin']}")
    per_vllm_process_ms = marginal / 1e3 + hooks_ms
    summary = {
        "paired": summaries,
        "bootstrap_import": boot,
        "attribution": attr,
        "startup_hook_own_modules_ms": own / 1e3,
        "startup_hook_marginal_in_vllm_process_ms": marginal / 1e3,
        "direct_overhead_per_vllm_process_ms": per_vllm_process_ms,
        "bare_interpreter_overhead_ms": boot["cumulative_us"]["median"] / 1e3,
        "target_ms": 20,
        "target_met_direct": per_vllm_process_ms < 20,
    }
    csv_path, _ = c.save("import_overhead", rows, {"summary": summary})
    print(
        f"\nplugin's own time in a process that imports vLLM (start-up hook modules "
        f"vLLM does not load + post-import hooks): {per_vllm_process_ms:.1f} ms; under "
        f"20 ms: {per_vllm_process_ms < 20}\nwrote {csv_path}"
    )


if __name__ == "__main__":
    main()
