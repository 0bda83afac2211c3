#!/usr/bin/env python3
"""The differential check of ``upstream/``: the same engine arguments on the
plugin (``.venv``) and on vLLM patched with ``upstream/vllm-0.32.0.patch``
(``.venv-upstream``, ``make test-upstream`` builds it); KV cache blocks and
bytes measured in the worker, or the error naming the cap. Prints a Markdown
table (``upstream/README.md`` holds the last one).

    .venv/bin/python scripts/upstream_differential.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import helpers  # noqa: E402

MiB = 2**20
PLUGIN = REPO / ".venv" / "bin" / "python"
PATCHED = REPO / ".venv-upstream" / "bin" / "python"
MODEL = REPO / "models" / "tiny-llama"
BASE = {**helpers.BASE_ENGINE_ARGS, "max_model_len": 512, "gpu_memory_utilization": 0.25, "prompts": []}
CASES: list[dict[str, Any]] = [
    {"kv_cache_max_memory": "16M"},
    {"kv_cache_max_memory": "64M"},
    {"kv_cache_max_memory": "1G"},
    {"kv_cache_max_memory": 16 * MiB + 12345},
    {"kv_cache_max_memory": "16M", "kv_cache_memory_bytes": 64 * MiB},
    {"kv_cache_max_memory": "32M", "kv_cache_memory_bytes": 16 * MiB},
    {"kv_cache_max_memory": "16M", "num_gpu_blocks_override": 1000},
    {"kv_cache_max_memory": "16M", "num_gpu_blocks_override": 64},
    {"kv_cache_max_memory": "16M", "max_model_len": 2048},
    {"kv_cache_max_memory": "300K"},
    {"kv_cache_max_memory": "100T"},
    {"kv_cache_memory_bytes": 48 * MiB},
]


def outcome(python: Path, case: dict[str, Any]) -> str:
    spec = {"model": str(MODEL), **BASE, **case}
    run = helpers.run_child([str(python), "-m", "tests.helpers", json.dumps(spec)], helpers.engine_env(), 600, REPO)
    result = run.result or {"ok": False, "error": f"no result (exit {run.returncode})"}
    if result["ok"]:
        return f"{result['num_gpu_blocks']} blocks, {result['kv_cache_bytes'][0]} bytes"
    errors = [result.get("error", ""), *helpers.logged_value_errors(run.log)]
    named = [e for e in errors if "--kv-cache-max-memory" in e]
    if not named:
        return f"error not naming the cap: {errors[0][:120]}"
    kind = (
        "too small"
        if "too small" in named[0]
        else "larger than the total memory"
        if "total memory" in named[0]
        else "other"
    )
    return f"error naming the cap ({kind})"


def main() -> int:
    for python in (PLUGIN, PATCHED):
        if not python.exists():
            print(f"{python} is missing: run make test-upstream first")
            return 2
    print(
        "| engine arguments (with max_model_len=512, gpu_memory_utilization=0.25, eager) | plugin | patched vLLM | same |"
    )
    print("| --- | --- | --- | --- |")
    same_all = True
    for case in CASES:
        plugin, patched = outcome(PLUGIN, case), outcome(PATCHED, case)
        same_all &= plugin == patched
        args = ", ".join(f"{k}={v!r}" for k, v in case.items())
        print(f"| `{args}` | {plugin} | {patched} | {'yes' if plugin == patched else '**no**'} |", flush=True)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
