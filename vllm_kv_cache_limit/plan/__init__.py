"""``vllm-kv-plan``: which ``--kv-cache-max-memory`` to pass, computed the way
vLLM computes its own KV cache.

MODEL is a local model folder or a model id already in the local Hugging Face
cache; nothing is downloaded and no weights are loaded.

Forward answer: bytes per token and per block, the memory that ``concurrency``
requests of ``max-model-len`` tokens need per device, and the smallest tidy
``--kv-cache-max-memory`` that gives those blocks. Reverse answer (with
``--kv-cache-max-memory``): the blocks, tokens and concurrency a cap gives.

The package keeps its four jobs apart: ``arithmetic`` (blocks, capacity, the
tidy cap; no vLLM), ``introspect`` (the model's KV cache read through vLLM,
the only module that calls it), ``report`` (the table and the JSON object)
and ``cli`` (the command line).
"""

from __future__ import annotations

from vllm_kv_cache_limit.plan.arithmetic import (
    NULL_BLOCKS,
    KVCachePlan,
    ModelKVCache,
    bytes_per_token,
    capacity,
    least_bytes_for,
    make_plan,
    required_blocks,
    suggest_cap,
)
from vllm_kv_cache_limit.plan.cli import build_parser, main, run
from vllm_kv_cache_limit.plan.errors import EXIT_ERROR, PROG, PlanError
from vllm_kv_cache_limit.plan.introspect import EXACT_ARCHITECTURES, load_model_kv_cache
from vllm_kv_cache_limit.plan.report import as_json, format_human

__all__ = [
    "EXACT_ARCHITECTURES",
    "EXIT_ERROR",
    "NULL_BLOCKS",
    "PROG",
    "KVCachePlan",
    "ModelKVCache",
    "PlanError",
    "as_json",
    "build_parser",
    "bytes_per_token",
    "capacity",
    "format_human",
    "least_bytes_for",
    "load_model_kv_cache",
    "main",
    "make_plan",
    "required_blocks",
    "run",
    "suggest_cap",
]
