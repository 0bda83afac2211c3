"""Tensor parallel 2 on the CPU backend where only rank 1 sees too little
memory: every rank raises the same cap error, start-up ends within a bound,
and no process is left. (A rank raising alone would leave the other waiting
forever in vLLM's next collective.) Rank 1's low reading comes from a
test-only vLLM plugin registered through an entry point on PYTHONPATH."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

from tests import helpers
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.e2e.conftest import FIXTURES, engine_env, with_plugins
from tests.e2e.test_side_by_side import bind_two_workers
from tests.e2e.test_startup_failures import DRIVER, GRACE_S, RUN_MARKER, run_watched, wait_until_gone

PLUGIN_DIR = FIXTURES / "fault_plugin"
MiB = 2**20
BOUND_S = 240
"""Start-up of a tensor-parallel-2 engine on the 2-core test machine takes
60-120 s; the error must come well before the tests' 300 s engine limit."""


def run_tensor_parallel_2(tiny_model: str, tmp_path: Path, **engine_args: object) -> tuple[dict, str, float]:
    """LLM(...) with tensor parallel 2 where rank 1 sees 8 MiB available;
    returns the error, the log and how long it took. No process may be left."""
    bind = bind_two_workers("tensor-parallel worker")
    marker = uuid.uuid4().hex
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    # vLLM's default utilization: rank 1's gate must see its own low reading.
    spec = {
        "model": tiny_model,
        **helpers.BASE_ENGINE_ARGS,
        "max_model_len": TEST_MAX_MODEL_LEN,
        "tensor_parallel_size": 2,
        **engine_args,
    }
    env = engine_env(
        **{
            RUN_MARKER: marker,
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "PYTHONPATH": with_plugins(PLUGIN_DIR),
            "KVCL_TEST_LOW_MEMORY_RANK": "1",
            "KVCL_TEST_LOW_MEMORY_BYTES": str(8 * MiB),
        }
    )
    log_path = tmp_path / "llm.log"
    started = time.monotonic()
    status, seen = run_watched([sys.executable, str(driver), json.dumps(spec), str(GRACE_S)], env, log_path)
    took = time.monotonic() - started
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if line.startswith("DRIVER_RESULT ")]
    assert lines, f"exit {status}:\n{log[-4000:]}"
    marked, alive = wait_until_gone(marker, seen)
    assert marked == [] and alive == [], (marked, alive)
    return json.loads(lines[-1][len("DRIVER_RESULT ") :])["error"], log, took


def test_only_rank_1_short_of_memory_fails_every_rank_without_hanging(tiny_model: str, tmp_path: Path) -> None:
    # Compiled (not eager), so that rank 0 enters vLLM's warm-up collective
    # while rank 1 has already failed the explicit-size check.
    error, log, took = run_tensor_parallel_2(
        tiny_model, tmp_path, enforce_eager=False, kv_cache_memory_bytes=16 * MiB, kv_cache_max_memory="16M"
    )
    assert error and error["type"] == "KVCacheMaxMemoryError", (error, log[-4000:])
    assert "The KV cache of 16777216 bytes" in error["message"], error
    assert "free memory of the host memory node" in error["message"] and "8MiB free" in error["message"], error
    # Both ranks raised it (rank 0 names rank 1, which found it).
    assert log.count("found by worker rank 1") >= 1, log[-4000:]
    assert took < BOUND_S, f"start-up took {took:.0f} s to fail"


def test_vllm_failing_on_rank_1_alone_after_profiling_does_not_hang(tiny_model: str, tmp_path: Path) -> None:
    """vLLM's own CPU gate fails on rank 1 only, after the profiling both
    ranks ran; rank 0 must not wait forever for rank 1 in the cap decision."""
    error, log, took = run_tensor_parallel_2(tiny_model, tmp_path, enforce_eager=True, kv_cache_max_memory="16M")
    assert error is not None, log[-4000:]
    assert "worker rank 1 failed while sizing the KV cache" in log, log[-4000:]
    assert took < BOUND_S, f"start-up took {took:.0f} s to fail"
