"""vllm.v1.core.block_pool: withhold blocks above the run-time limit."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, RESIZE_UPSTREAM, optional
from vllm_kv_cache_limit.hooks.runtime.limit import RuntimeLimit
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import limit_math


def patch(module: Any) -> None:
    """Why: the scheduler allocates from ``BlockPool.free_block_queue``; a
    run-time limit must keep blocks above it out of that queue, also when
    requests free them. How: wraps ``BlockPool.free_blocks`` (and
    ``unpin_blocks`` where present) to withhold freed blocks above the limit,
    and ``get_usage`` to be relative to the limit, and ``reset_prefix_cache``
    to count withheld blocks as free; without a limit each calls vLLM's
    original unchanged."""
    pool = module.BlockPool
    # ``unpin_blocks`` where this vLLM has it: it frees blocks as ``free_blocks`` does.
    optional(BLOCK_POOL_FREE_BLOCKS, functools.partial(wrap, pool, "free_blocks", _withhold_after))
    if hasattr(pool, "unpin_blocks"):  # vLLM 0.30 on (BLOCK_POOL_UNPIN_BLOCKS)
        optional(BLOCK_POOL_UNPIN_BLOCKS, functools.partial(wrap, pool, "unpin_blocks", _withhold_after))
    optional(BLOCK_POOL_GET_USAGE, functools.partial(wrap, pool, "get_usage", _usage_under_limit))
    optional(BLOCK_POOL_CACHE_FULL_BLOCKS, functools.partial(wrap, pool, "cache_full_blocks", _uncache_above_limit))
    optional(BLOCK_POOL_RESET_PREFIX_CACHE, functools.partial(wrap, pool, "reset_prefix_cache", _reset_with_withheld))


def _withhold_after(original: Callable) -> Callable:
    def method(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        limit = RuntimeLimit.of(self)
        if limit is None:
            return original(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        result = original(self, blocks, *args, **kwargs)
        limit.withhold(blocks)
        return result

    return method


def _uncache_above_limit(original: Callable) -> Callable:
    """Why: a block above the limit that a running request fills after the
    limit was lowered would enter the prefix cache, and a new request with
    the same prefix would be handed it (so a drain might never end). How:
    wraps ``BlockPool.cache_full_blocks``; under a limit, the blocks this
    call adds (``blocks[num_cached_blocks:num_full_blocks]``; ``blocks`` is
    all of the request's) at or above it leave the prefix cache at once.
    Without a limit, vLLM's original alone."""

    def cache_full_blocks(
        self: Any, request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int, *args: Any, **kwargs: Any
    ) -> Any:
        result = original(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        limit = RuntimeLimit.of(self)
        if limit is not None:
            for block in blocks[num_cached_blocks:num_full_blocks]:
                if block.block_id >= limit.limit and not block.is_null:
                    self._maybe_evict_cached_block(block)
        return result

    return cache_full_blocks


def _reset_with_withheld(original: Callable) -> Callable:
    """Why: vLLM resets the prefix cache (RLHF weight updates,
    ``/reset_prefix_cache``) only when every block but the null one is
    free, and withheld blocks are out of the free queue, so under a lowered
    limit it always refused ("some blocks (N) are not freed yet"). How:
    wraps ``BlockPool.reset_prefix_cache``; under a limit the withheld
    blocks (free, uncached) are queued for vLLM's original and withheld
    again after it, whatever it returns or raises. Without a limit, vLLM's
    original alone."""

    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        limit = RuntimeLimit.of(self)
        if limit is None or not limit.withheld:
            return original(self, *args, **kwargs)
        with limit.withheld_queued():
            return original(self, *args, **kwargs)

    return reset_prefix_cache


def _usage_under_limit(original: Callable) -> Callable:
    def get_usage(self: Any) -> float:
        limit = RuntimeLimit.of(self)
        if limit is None:
            return original(self)
        usable = limit.limit - limit_math.NULL_BLOCKS
        if usable <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.get_num_free_blocks() / usable))

    return get_usage


BLOCK_POOL_FREE_BLOCKS = Hook(
    ("vllm.v1.core.block_pool",),
    "BlockPool.free_blocks",
    ("self", "ordered_blocks"),
    wrapper=_withhold_after,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

BLOCK_POOL_UNPIN_BLOCKS = Hook(
    ("vllm.v1.core.block_pool",),
    "BlockPool.unpin_blocks",
    ("self", "blocks", "on_reuse"),
    versions=">=0.30",
    wrapper=_withhold_after,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

BLOCK_POOL_GET_USAGE = Hook(
    ("vllm.v1.core.block_pool",),
    "BlockPool.get_usage",
    ("self",),
    wrapper=_usage_under_limit,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

BLOCK_POOL_CACHE_FULL_BLOCKS = Hook(
    ("vllm.v1.core.block_pool",),
    "BlockPool.cache_full_blocks",
    ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks"),
    wrapper=_uncache_above_limit,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

BLOCK_POOL_RESET_PREFIX_CACHE = Hook(
    ("vllm.v1.core.block_pool",),
    "BlockPool.reset_prefix_cache",
    ("self",),
    wrapper=_reset_with_withheld,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

BLOCK_POOL_MAYBE_EVICT_CACHED_BLOCK = Hook(
    ("vllm.v1.core.block_pool",), "BlockPool._maybe_evict_cached_block", ("self", "block")
)

FREE_BLOCK_QUEUE_REMOVE = Hook(("vllm.v1.core.kv_cache_utils",), "FreeKVCacheBlockQueue.remove", ("self", "block"))

# Called, not wrapped: the free blocks, every step under a limit (``get_usage``)
# and in the status (``RuntimeLimit.usage``).
BLOCK_POOL_GET_NUM_FREE_BLOCKS = Hook(("vllm.v1.core.block_pool",), "BlockPool.get_num_free_blocks", ("self",))

HOOKS = (
    BLOCK_POOL_FREE_BLOCKS,
    BLOCK_POOL_UNPIN_BLOCKS,
    BLOCK_POOL_GET_USAGE,
    BLOCK_POOL_MAYBE_EVICT_CACHED_BLOCK,
    FREE_BLOCK_QUEUE_REMOVE,
    BLOCK_POOL_GET_NUM_FREE_BLOCKS,
    BLOCK_POOL_CACHE_FULL_BLOCKS,
    BLOCK_POOL_RESET_PREFIX_CACHE,
)

TARGETS = {"vllm.v1.core.block_pool": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
