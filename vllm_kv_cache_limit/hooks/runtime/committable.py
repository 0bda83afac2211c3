"""What a raised run-time limit may commit on vLLM 0.34's extensible KV
cache: the engine core asks its workers (``WorkerBase.kv_cache_limit_committable``,
vLLM's ``ExtensibleKVCache.committable_blocks``) before a grow, so that a
limit never takes the memory vLLM keeps free for activations.
"""

from __future__ import annotations

from typing import Any

from vllm_kv_cache_limit.logic.errors import KVCacheResizeError
from vllm_kv_cache_limit.logic.sizes import format_size


def committable_of(engine_core: Any) -> int | None:
    """The most blocks a raised limit may reach now: the least over the
    workers of what each can commit beside the memory vLLM keeps for
    activations; None where no worker commits memory for a limit (no
    extensible KV cache, or one not mapped in chunks: the limit is logical)."""
    if not getattr(engine_core.vllm_config.cache_config, "enable_extensible_kv_cache", False):
        return None
    bounds = [int(b) for b in engine_core.model_executor.collective_rpc("kv_cache_limit_committable")]
    return min((b for b in bounds if b >= 0), default=None)


def most_blocks(engine_core: Any, current: int) -> int | None:
    """The largest limit accepted now, in blocks (never below ``current``,
    which holds its memory already); None: no bound."""
    committable = committable_of(engine_core)
    return None if committable is None else max(committable, current)


def refuse_above(engine_core: Any, nbytes: int, new: int, current: int, bytes_per_block: int) -> None:
    """Refuse a raise to ``new`` blocks (``nbytes`` asked) past what the
    workers can commit, naming the largest size accepted."""
    most = most_blocks(engine_core, current)
    if most is None or new <= most:
        return
    most_bytes = most * bytes_per_block
    raise KVCacheResizeError(
        f"Cannot raise the KV cache limit to {format_size(nbytes)} ({nbytes} bytes): the GPU can back at most "
        f"{format_size(most_bytes)} ({most_bytes} bytes, {most} blocks) of KV cache per worker now without taking "
        "the memory vLLM keeps free for activations (its extensible KV cache's committable blocks; more as the "
        f"device frees memory). Choose a size of at most {format_size(most_bytes)} ({most_bytes} bytes)."
    )
