"""The planner's arithmetic: blocks, capacity, the tidy cap, and the plan
made of them from a model's KV cache as vLLM plans it.

Pure logic: no vLLM and no torch import (a test holds it to that), so the
numbers can be checked without an engine; ``introspect`` reads the model's
KV cache through vLLM and hands it over as a :class:`ModelKVCache`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_cache_limit.logic.cap_decision import FLAG
from vllm_kv_cache_limit.logic.limit_math import NULL_BLOCKS as NULL_BLOCKS  # one definition, re-exported
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.plan.errors import PlanError

PROBE_BYTES = 1 << 50
"""Memory handed to vLLM's planning to read the block size in bytes: only
numbers are computed, nothing is allocated. Also the largest size searched."""


def required_blocks(blocks_per_request: int, concurrency: int) -> int:
    """Blocks a device needs so that ``concurrency`` requests, each holding
    ``blocks_per_request`` blocks, run at once, plus the null block."""
    if blocks_per_request < 1:
        raise ValueError(f"blocks_per_request must be at least 1, got {blocks_per_request}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    return concurrency * blocks_per_request + NULL_BLOCKS


def capacity(num_blocks: int, blocks_per_request: int, max_model_len: int) -> tuple[int, int, int]:
    """What ``num_blocks`` blocks hold: ``(usable_blocks, tokens,
    max_concurrency)``.

    ``usable_blocks`` leaves out the null block; ``max_concurrency`` is the
    number of requests of ``max_model_len`` tokens that fit at once; ``tokens``
    is the token capacity as vLLM defines it (usable blocks over the blocks of
    one full-length request, times ``max_model_len``). vLLM's own start-up log
    line counts the null block too, so it reports one block more.
    """
    if blocks_per_request < 1:
        raise ValueError(f"blocks_per_request must be at least 1, got {blocks_per_request}")
    usable = max(0, num_blocks - NULL_BLOCKS)
    return usable, usable * max_model_len // blocks_per_request, usable // blocks_per_request


def bytes_per_token(bytes_per_block: int, block_size: int) -> int | float:
    """KV cache bytes per token of one device: an int when the block divides
    evenly (it does for plain attention layers)."""
    whole, rest = divmod(bytes_per_block, block_size)
    return whole if rest == 0 else bytes_per_block / block_size


def least_bytes_for(needed_blocks: int, start: int, blocks_for: Callable[[int], int]) -> int:
    """The fewest bytes that ``blocks_for`` (monotonic) turns into at least
    ``needed_blocks`` blocks, searched from ``start``."""
    if blocks_for(start) >= needed_blocks:
        if start <= 1 or blocks_for(start - 1) < needed_blocks:
            return start
        low, high = 0, start
    else:
        low, high = start, start * 2
        while blocks_for(high) < needed_blocks:
            if high > PROBE_BYTES:
                raise PlanError(f"no size up to {format_size(high)} gives {needed_blocks} KV cache blocks")
            low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if blocks_for(mid) >= needed_blocks:
            high = mid
        else:
            low = mid
    return high


def suggest_cap(required_bytes: int, needed_blocks: int, blocks_for: Callable[[int], int]) -> tuple[str, int, int]:
    """The smallest tidy size (``format_size(..., "up")``) that gives at least
    ``needed_blocks`` blocks when ``blocks_for`` (the engine's own rounding)
    turns it into blocks. Returns ``(text, bytes, blocks)``."""
    least = least_bytes_for(needed_blocks, required_bytes, blocks_for)
    text = format_size(least, "up")
    nbytes = parse_size(text)
    blocks = blocks_for(nbytes)
    if blocks < needed_blocks:  # blocks_for is not monotonic: a vLLM change
        raise PlanError(
            f"{text} gives {blocks} KV cache blocks under vLLM's rounding, fewer than "
            f"the {needed_blocks} that {least} bytes give"
        )
    return text, nbytes, blocks


@dataclass
class ModelKVCache:
    """A model's KV cache as vLLM would plan it on this machine, per device."""

    model: str
    architecture: str
    exact: bool
    estimate_reason: str | None
    vllm_version: str
    platform: str
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_batched_tokens: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    bytes_per_block: int
    blocks_per_request: int
    num_groups: int = 1
    """vLLM's KV cache groups: a request takes blocks in each."""
    layers: list[dict[str, Any]] = field(default_factory=list)
    blocks_for: Callable[[int], int] = field(default=lambda nbytes: 0, repr=False)
    """Blocks vLLM gives one device for a KV cache budget of ``nbytes``."""


@dataclass
class KVCachePlan:
    """Everything the planner reports (``report`` writes it out)."""

    kv: ModelKVCache
    concurrency: int
    required_blocks: int
    required_bytes: int
    suggested: str
    suggested_bytes: int
    suggested_num_blocks: int
    cap: str | None = None
    cap_bytes: int | None = None
    num_blocks: int | None = None


def make_plan(kv: ModelKVCache, concurrency: int, cap: str | None = None) -> KVCachePlan:
    """Forward answer for ``concurrency`` requests, and the reverse answer
    for ``cap`` when given."""
    needed = required_blocks(kv.blocks_per_request, concurrency)
    suggested, suggested_bytes, suggested_blocks = suggest_cap(needed * kv.bytes_per_block, needed, kv.blocks_for)
    plan = KVCachePlan(
        kv=kv,
        concurrency=concurrency,
        required_blocks=needed,
        required_bytes=needed * kv.bytes_per_block,
        suggested=suggested,
        suggested_bytes=suggested_bytes,
        suggested_num_blocks=suggested_blocks,
    )
    if cap is not None:
        cap_bytes = parse_size(cap)
        minimum = required_blocks(kv.blocks_per_request, 1) * kv.bytes_per_block
        if cap_bytes < minimum:
            raise PlanError(
                f"{FLAG} {cap} ({cap_bytes} bytes) is too small: vLLM refuses to start unless the KV "
                f"cache holds one request of {kv.max_model_len} tokens ({kv.blocks_per_request} blocks) "
                f"plus the null block, {minimum} bytes per device; pass at least "
                f"{FLAG} {format_size(minimum, 'up')} or a smaller --max-model-len"
            )
        plan.cap, plan.cap_bytes, plan.num_blocks = cap, cap_bytes, kv.blocks_for(cap_bytes)
    return plan
