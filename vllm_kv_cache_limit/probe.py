"""Start a vLLM engine, measure the KV cache its workers allocated, and print
one JSON line. Used by the end-to-end tests and the benchmarks, each engine
in its own process so that nothing outlives the measurement.

    python -m vllm_kv_cache_limit.probe '{"model": "models/tiny-llama", "kv_cache_max_memory": "16M"}'

The JSON object holds ``LLM(...)`` keyword arguments plus optional probe
settings: ``prompts`` (list of str) and ``max_tokens`` for a greedy
generation. The output line starts with ``PROBE_RESULT `` and holds
``kv_cache_bytes`` (per worker, summed over the storages of the KV cache
tensors), ``num_gpu_blocks``, ``block_size``, ``texts`` and, on failure,
``error_type`` and ``error``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RESULT_PREFIX = "PROBE_RESULT "


def kv_cache_storages(worker: Any) -> dict[int, tuple[int, str]]:
    """The distinct storages behind a worker's ``model_runner.kv_caches``
    tensors (views of one buffer count once): ``{data_ptr: (bytes, device)}``."""
    import torch

    storages: dict[int, tuple[int, str]] = {}

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), str(item.device))
        elif isinstance(item, (list, tuple)):
            for sub in item:
                walk(sub)
        elif isinstance(item, dict):
            for sub in item.values():
                walk(sub)

    walk(worker.model_runner.kv_caches)
    return storages


def worker_kv_cache_bytes(worker: Any) -> int:
    """Bytes of KV cache a worker holds (for ``LLM.collective_rpc``)."""
    return sum(nbytes for nbytes, _ in kv_cache_storages(worker).values())


class KVCacheProbe:
    """Worker extension for servers under test
    (``--worker-extension-cls vllm_kv_cache_limit.probe.KVCacheProbe``): with
    ``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc {"method":
    "kv_cache_bytes"}`` returns each worker's KV cache bytes."""

    def kv_cache_bytes(self) -> int:
        return worker_kv_cache_bytes(self)


def worker_rss_bytes(worker: Any) -> int:
    """Resident memory of the worker process."""
    import psutil

    return psutil.Process().memory_info().rss


def engine_cache_settings(llm: Any) -> dict[str, Any]:
    """The KV cache settings an ``LLM`` ended up with, as its engine config
    holds them after start-up."""
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    return {
        "num_gpu_blocks": cache_config.num_gpu_blocks,
        "block_size": cache_config.block_size,
        "num_gpu_blocks_override": cache_config.num_gpu_blocks_override,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "kv_cache_max_memory": getattr(cache_config, "kv_cache_max_memory", None),
        "max_model_len": vllm_config.model_config.max_model_len,
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    spec = dict(spec)
    prompts = spec.pop("prompts", ["Hello, my name is"])
    max_tokens = spec.pop("max_tokens", 8)
    result: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**spec)
        result["startup_s"] = time.perf_counter() - started
        result["kv_cache_bytes"] = llm.collective_rpc(worker_kv_cache_bytes)
        result["worker_rss_bytes"] = llm.collective_rpc(worker_rss_bytes)
        result.update(engine_cache_settings(llm))
        if prompts:
            outputs = llm.generate(
                prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0)
            )
            result["texts"] = [o.outputs[0].text for o in outputs]
        result["ok"] = True
    except Exception as exc:  # reported, not raised: the caller reads the line
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)
        result["error_mro"] = [c.__name__ for c in type(exc).__mro__]
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = run(spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
