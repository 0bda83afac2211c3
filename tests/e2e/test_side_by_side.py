"""Workers side by side on one machine, each with the cap: tensor parallel 2
and pipeline parallel 2 on the CPU backend, where each worker keeps to it.
Servers side by side, each with its own cap, are checked on
``test_sharing``'s three servers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

MiB = 2**20
CAP = 16 * MiB


def kv_bytes_per_block(model: str, block_size: int, tensor_parallel_size: int = 1) -> int:
    """KV cache bytes of one block in one worker: K and V, every layer, the
    worker's share of the KV heads, bfloat16 (the CPU backend's KV dtype)."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config["num_key_value_heads"] // tensor_parallel_size
    return 2 * config["num_hidden_layers"] * heads * head_dim * 2 * block_size


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def bind_two_workers(what: str) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two local CPU workers, half the
    allowed cores each; skips with the reason when fewer than 2 cores. With
    one NUMA node, vLLM's automatic binding refuses two local workers ("Not
    enough allowed NUMA nodes"); binding them explicitly is what it suggests."""
    cpus = allowed_cpus()
    if len(cpus) < 2:
        pytest.skip(
            f"vLLM's CPU backend binds each {what} to its own CPU cores "
            f"(VLLM_CPU_OMP_THREADS_BIND); this process may use only {len(cpus)} core(s): {cpus}"
        )
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])) + "|" + ",".join(map(str, cpus[half:]))


def run_two_workers(probe: Any, what: str, worker: str, cap: int, **engine_args: Any) -> dict[str, Any]:
    """Start the tiny model on two CPU workers (``what``, e.g. "tensor
    parallel 2"; each a ``worker``) with ``cap`` and return the result. A
    failure of the plugin fails the test; one of vLLM's own (no plugin frame
    in the traceback, not the plugin's error) skips it with vLLM's error, since
    the CPU build cannot run it here."""
    bind = bind_two_workers(worker)
    result, log = probe(
        env={"VLLM_CPU_OMP_THREADS_BIND": bind},
        gpu_memory_utilization=0.2,
        kv_cache_max_memory=f"{cap // MiB}M",
        **engine_args,
    )
    if not result["ok"]:
        plugin_frames = [line for line in log.splitlines() if 'File "' in line and "vllm_kv_cache_limit" in line]
        if result.get("error_type") != "KVCacheMaxMemoryError" and not plugin_frames:
            causes = [line for line in log.splitlines() if re.search(r"\b\w*(Error|Exception):", line)]
            pytest.skip(f"vLLM's CPU build cannot run {what} here: {(causes or [result.get('error')])[0].strip()}")
        pytest.fail(f"{result.get('error_type')}: {result.get('error')}\n{log[-4000:]}")
    return result


def metric_labels(metrics: str, name: str) -> dict[str, str]:
    line = next(line for line in metrics.splitlines() if line.startswith(name + "{"))
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line))


def metric_sum(metrics: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_tensor_parallel_2_each_worker_respects_the_cap(probe, tiny_model: str) -> None:
    """Tensor parallel 2 on the CPU backend: the cap is per worker, measured
    in each worker from its KV cache tensors."""
    cap = CAP
    result = run_two_workers(probe, "tensor parallel 2", "tensor-parallel worker", cap, tensor_parallel_size=2)
    per_block = kv_bytes_per_block(tiny_model, result["block_size"], tensor_parallel_size=2)
    assert len(result["kv_cache_bytes"]) == 2
    for measured in result["kv_cache_bytes"]:
        assert measured <= cap
        assert measured == result["num_gpu_blocks"] * per_block
    assert cap - per_block < result["num_gpu_blocks"] * per_block
    assert result["texts"] and result["texts"][0]


def test_pipeline_parallel_2_each_worker_respects_the_cap(probe, tiny_model: str) -> None:
    """Pipeline parallel 2 on the CPU backend: each stage's worker holds one
    of the two layers and keeps to the cap. Only the allocation is checked:
    generating with pipeline parallelism fails in vLLM 0.32's CPU build with
    or without the plugin (an AssertionError in the second stage's worker)."""
    cap = CAP
    result = run_two_workers(
        probe, "pipeline parallel 2", "pipeline stage's worker", cap, pipeline_parallel_size=2, prompts=[]
    )
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    # One of the two layers per stage: half the bytes per block of one worker.
    per_block = kv_bytes_per_block(tiny_model, result["block_size"]) // config["num_hidden_layers"]
    assert len(result["kv_cache_bytes"]) == 2
    for measured in result["kv_cache_bytes"]:
        assert measured == result["num_gpu_blocks"] * per_block <= cap
    assert cap - per_block < result["num_gpu_blocks"] * per_block
