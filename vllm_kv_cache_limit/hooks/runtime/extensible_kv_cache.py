"""vllm.v1.worker.extensible_kv_cache: under a cap, vLLM 0.34's extensible
KV cache is mapped in chunks (``hooks.runtime.extensible_tensor``) so that a
run-time limit returns the GPU memory above it and commits it again when the
limit rises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.runtime import extensible_tensor, kv_connectors
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, optional
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.errors import KVCacheResizeError
from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.logic.vmm_chunks import ChunkPlan, plan_chunks

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

NO_RETURN_HINT = (
    "Turn that off, or run with --no-enable-extensible-kv-cache, where a run-time limit keeps the memory "
    "allocated and only stops the engine from using it."
)

LAYOUT_HINT = (
    "A run-time limit on this engine keeps the memory allocated and only stops the engine from using it; "
    "a block-compact layout returns it: set VLLM_KV_CACHE_LAYOUT=LBHNC (which rocm_attn and rocm_aiter_fa "
    "also accept)."
)


def patch(module: Any) -> None:
    """Why: vLLM commits the KV cache's final size after warmup in one run
    per segment, which the driver can only unmap whole. How: wraps
    ``extend_kv_cache``; with a cap in force and nothing that needs the
    whole mapping, the cache is given a chunk plan first (a cache warmup
    mapped across its cuts is remapped: it holds warmup's garbage), then
    vLLM's original commits the final size, in chunks. Without a cap: the
    original alone."""
    optional(EXTEND_KV_CACHE, functools.partial(wrap, module, "extend_kv_cache", _chunked_before))
    optional(MEASURE_KV_CACHE_BLOCKS, functools.partial(wrap, module, "measure_kv_cache_blocks", _remember_measured))


def refusal(vllm_config: Any) -> str | None:
    """What in this engine's configuration needs the extensible KV cache's
    whole mapping, so that memory above a run-time limit cannot be returned
    (None: nothing; also without the extensible cache)."""
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, "enable_extensible_kv_cache", False):
        return None
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None and transfer.registers_kv_cache_memory():
        return (
            f"the KV connector {getattr(transfer, 'kv_connector', None)!r} registers the KV cache's memory "
            "for RDMA, which needs each segment mapped as one allocation"
        )
    if (freed := kv_connectors.reads_freed_blocks(transfer)) is not None:
        return freed
    attention = getattr(vllm_config, "attention_config", None)
    if getattr(attention, "hisparse_config", None) is not None:
        return "HiSparse attention reads unpinned blocks after they are freed"
    return None


def _remember_measured(original: Callable) -> Callable:
    """Why: under a cap the engine core may extend the cache to the cap's
    reservation while warmup measured room for fewer blocks; this worker
    then commits only what it measured. How: wraps
    ``measure_kv_cache_blocks``; the result is kept in the worker's state,
    which the cache and the config then share."""

    def measure_kv_cache_blocks(kv_cache: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> int:
        num_blocks = original(kv_cache, vllm_config, *args, **kwargs)
        if cap_of(vllm_config.cache_config) is not None:
            WorkerState.of_config(vllm_config, kv_cache).measured = num_blocks
        return num_blocks

    return measure_kv_cache_blocks


def _chunked_before(original: Callable) -> Callable:
    def extend_kv_cache(runner: Any, kv_cache_config: Any, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        kv_cache = getattr(runner, "extensible_kv_cache", None)
        if kv_cache is None or cap_of(runner.cache_config) is None:
            return original(runner, kv_cache_config, num_blocks, *args, **kwargs)
        state = WorkerState.of_config(runner.vllm_config, kv_cache)
        _give_plan(runner, kv_cache, state)
        measured = state.measured
        if plan_of(kv_cache) is None or measured is None or measured >= num_blocks:
            result = original(runner, kv_cache_config, num_blocks, *args, **kwargs)
        else:
            result = _extend_committing(
                original, kv_cache, measured, runner, kv_cache_config, num_blocks, *args, **kwargs
            )
        state.started = kv_cache.num_committed_blocks
        return result

    return extend_kv_cache


def _extend_committing(original: Callable, kv_cache: Any, measured: int, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``extend_kv_cache`` to the block count it is given (the cap's
    reservation: views, block tables and bindings over all of it), with
    only the ``measured`` blocks mapped; the cache then counts those as
    committed, as a run-time limit at them would leave it."""
    commit = kv_cache.commit
    strides = kv_cache.segment_strides

    def commit_measured(num_blocks: int, defragment: bool = False, shrink: bool = False) -> None:
        commit(min(num_blocks, measured), defragment=defragment, shrink=shrink)
        # vLLM builds the views over the blocks it asked for: their addresses are reserved.
        kv_cache.num_committed_blocks = min(num_blocks, kv_cache.capacity_blocks)
        kv_cache.buffer._committed = [kv_cache.num_committed_blocks * stride for stride in strides]

    kv_cache.commit = commit_measured
    try:
        result = original(*args, **kwargs)
    finally:
        del kv_cache.commit
    kv_cache.num_committed_blocks = min(kv_cache.num_committed_blocks, measured)
    kv_cache.buffer._committed = [kv_cache.num_committed_blocks * stride for stride in strides]
    logger.info(
        "KV cache max memory: %d of the %d blocks reserved are committed (%s); the rest is committed as a "
        "run-time limit grows.",
        kv_cache.num_committed_blocks,
        kv_cache.capacity_blocks,
        format_size(kv_cache.physical_bytes),
    )
    return result


def _give_plan(runner: Any, kv_cache: Any, state: WorkerState) -> None:
    reason = refusal(runner.vllm_config)
    plan = (
        plan_chunks(
            list(kv_cache.segment_offsets),
            list(kv_cache.segment_strides),
            kv_cache.capacity_blocks,
            kv_cache.buffer.granularity,
        )
        if reason is None
        else reason
    )
    if isinstance(plan, str):
        hint = NO_RETURN_HINT
        if reason is None:  # the layout's segments, not a feature
            layout = runner.cache_config.get_resolved_kv_cache_layout()
            plan = f"the KV cache layout {layout.name} gives it segments that {plan.removeprefix('its segments ')}"
            hint = LAYOUT_HINT
        state.refusal, state.hint = plan, hint
        logger.warning(
            "KV cache max memory: a run-time limit cannot return GPU memory on this engine: %s. %s", plan, hint
        )
        return
    buffer = kv_cache.buffer._buffer
    extensible_tensor.give_plan(buffer, plan)
    crossing = [(offset, size) for _, offset, size in buffer._handles if plan.cuts(offset, offset + size)]
    if crossing:
        # Warmup's blocks, mapped before the plan: garbage, as vLLM itself says
        # when it remaps them in extend_kv_cache.
        kv_cache.commit(kv_cache.min_committed_blocks, shrink=True)
    logger.info(
        "KV cache max memory: the extensible KV cache is mapped in chunks of %d blocks (%s over %d segments), "
        "so that a run-time limit returns the memory above it.",
        plan.blocks_per_chunk,
        format_size(plan.chunk_bytes()),
        len(plan.segment_strides),
    )


def plan_of(kv_cache: Any) -> ChunkPlan | None:
    """The cache's chunk plan, if it was given one (kept on its buffer, which maps by it)."""
    return extensible_tensor.plan_of(kv_cache.buffer._buffer)


def chunks_of(kv_cache: Any) -> ChunkPlan:
    """The cache's chunk plan; refuses, naming why, where it has none."""
    plan = plan_of(kv_cache)
    if plan is None:
        state = WorkerState.peek(kv_cache)
        reason = None if state is None else state.refusal
        if state is None or reason is None:
            raise KVCacheResizeError(
                "Cannot return the KV cache's GPU memory above the limit: the KV cache was not mapped in chunks "
                "(no cap was in force when vLLM extended it). Start the engine with --kv-cache-max-memory."
            )
        hint = state.hint or NO_RETURN_HINT
        raise KVCacheResizeError(f"Cannot return the KV cache's GPU memory above the limit: {reason}. {hint}")
    return plan


def release_above(kv_cache: Any, keep: int) -> int:
    """Unmap and release every chunk holding no block below ``keep``; the
    blocks below keep their contents. Returns the bytes released."""
    plan = chunks_of(kv_cache)
    keep = max(keep, kv_cache.min_committed_blocks)
    buffer = kv_cache.buffer._buffer
    going = set(plan.releasable([(offset, size) for _, offset, size in buffer._handles], keep))
    entries = [entry for entry in buffer._handles if (entry[1], entry[2]) in going]
    if entries:
        _synchronize(kv_cache)
    before = kv_cache.physical_bytes
    extensible_tensor.unmap(buffer, entries)
    tensor = kv_cache.buffer
    tensor._committed = [min(size, keep * stride) for size, stride in zip(tensor._committed, kv_cache.segment_strides)]
    kv_cache.num_committed_blocks = min(kv_cache.num_committed_blocks, keep)
    return before - kv_cache.physical_bytes


def clear_stale_block_ids(runner: Any, kv_cache: Any, keep: int) -> int:
    """Point every block-table entry at or above ``keep`` to the null block
    (0); returns how many were. Why: vLLM's GPU model runner writes a row's
    block ids from its start and leaves the entries past its length as they
    were (a finished or preempted request's), and copies only a row's length
    into the forward pass's tables, so after a release those tables may name
    blocks whose memory is gone. The attention kernels in vLLM read KV data
    only within a sequence's length; this keeps any code that reads past it
    (a precompiled kernel's tile, a prefetch) on mapped memory. The requests
    left all hold blocks below ``keep`` (the limit drained the others), so
    no work in flight reads an entry this changes within a row's length:
    no wait here (``release_above`` waited before any memory went), and
    the change is queued on the device after that work."""
    tables = getattr(runner, "block_tables", None)
    if tables is None:  # not vLLM's GPU model runner: no persistent block tables
        return 0
    targets = [table.gpu for table in tables.block_tables] + list(tables.input_block_tables)
    pcp = getattr(runner, "pcp_manager", None)
    targets += list(getattr(pcp, "_local_block_tables", None) or ())
    cleared = 0
    for table in targets:
        stale = table >= keep
        cleared += int(stale.sum())
        table.masked_fill_(stale, 0)
    return cleared


def commit_up_to(kv_cache: Any, keep: int) -> None:
    """Map blocks ``[0, keep)`` again (zeroed, as vLLM's ``commit``); on a
    driver failure, the chunks this call mapped are released and the cache
    is as it was: nothing half mapped."""
    chunks_of(kv_cache)
    buffer = kv_cache.buffer._buffer
    handles = list(buffer._handles)
    committed, blocks = list(kv_cache.buffer._committed), kv_cache.num_committed_blocks
    try:
        kv_cache.commit(keep)
    except BaseException:
        extensible_tensor.unmap(buffer, [entry for entry in buffer._handles if entry not in handles])
        kv_cache.buffer._committed, kv_cache.num_committed_blocks = committed, blocks
        raise


def pages(kv_cache: Any, keep: int, num_blocks: int, release: bool) -> int:
    """The worker's side of ``RuntimeLimit.pages`` on an extensible cache:
    release the chunks above ``keep`` (returns the bytes released), or
    commit up to ``keep`` (returns the bytes still released above it). A
    cache without a chunk plan keeps all its memory (the limit is logical):
    it says so once, and returns 0."""
    if plan_of(kv_cache) is None:
        _say_memory_stays(kv_cache)
        return 0
    if release:
        return release_above(kv_cache, keep)
    if not kv_cache.physical_bytes:
        # Asleep (or the cache discarded): vLLM's wake-up recommits this many.
        kv_cache.num_committed_blocks = max(kv_cache.num_committed_blocks, min(keep, num_blocks))
        return 0
    commit_up_to(kv_cache, min(keep, num_blocks))
    return max(0, kv_cache.physical_bytes_for(num_blocks) - kv_cache.physical_bytes)


def _say_memory_stays(kv_cache: Any) -> None:
    """One line, once per cache: why a lower limit returns no GPU memory here."""
    state = WorkerState.of(kv_cache)
    if state.said_stays:
        return
    state.said_stays = True
    reason = state.refusal
    if reason is None:
        logger.info(
            "KV cache max memory: the extensible KV cache is not mapped in chunks (no cap was in force when vLLM "
            "extended it), so a run-time limit keeps its GPU memory allocated and only stops the engine from "
            "using the blocks above it. Start the engine with --kv-cache-max-memory to have it returned."
        )
        return
    logger.warning(
        "KV cache max memory: the extensible KV cache is not mapped in chunks (%s), so a run-time limit keeps "
        "its GPU memory allocated and only stops the engine from using the blocks above it.",
        reason,
    )


def committable(kv_cache: Any) -> int:
    """The most blocks a raised limit may commit on this worker now (-1: no
    bound: a cache without a chunk plan commits nothing). Why: past what vLLM
    sized after warmup, a commit takes the memory vLLM keeps for activations
    (a later forward pass runs out of it). How: the larger of what vLLM
    committed at start-up and its ``committable_blocks()``, which must also
    leave free what torch may still reserve under vLLM's limit."""
    if plan_of(kv_cache) is None:
        return -1
    import torch

    now = kv_cache.committable_blocks()
    torch_limit = kv_cache.torch_memory_limit
    if torch_limit is not None:
        device = kv_cache.buffer.device
        free, _ = torch.accelerator.get_memory_info(device)
        torch_may_take = max(0, torch_limit - torch.accelerator.memory_reserved(device))
        now = min(now, kv_cache.blocks_within(free + kv_cache.physical_bytes - torch_may_take))
    state = WorkerState.peek(kv_cache)
    started = kv_cache.capacity_blocks if state is None or state.started is None else state.started
    return min(kv_cache.capacity_blocks, max(started, kv_cache.num_committed_blocks, now))


def _synchronize(kv_cache: Any) -> None:
    """Wait for the device's work on the cache (a step in flight may still
    write the blocks above the limit) before their memory goes."""
    import torch

    torch.accelerator.synchronize(kv_cache.buffer.device)


EXTEND_KV_CACHE = Hook(
    ("vllm.v1.worker.extensible_kv_cache",),
    "extend_kv_cache",
    ("runner", "kv_cache_config", "num_blocks"),
    versions=">=0.34",
    wrapper=_chunked_before,
    upstream=extensible_tensor.UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

MEASURE_KV_CACHE_BLOCKS = Hook(
    ("vllm.v1.worker.extensible_kv_cache",),
    "measure_kv_cache_blocks",
    ("kv_cache", "vllm_config", "device"),
    versions=">=0.34",
    wrapper=_remember_measured,
    upstream=extensible_tensor.UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

# Called, not wrapped: committing up to a raised limit; the physical bytes.
EXTENSIBLE_KV_CACHE_COMMIT = Hook(
    ("vllm.v1.worker.extensible_kv_cache",),
    "ExtensibleKVCache.commit",
    ("self", "num_blocks", "defragment", "shrink"),
    versions=">=0.34",
)
# Called, not wrapped: what a raised limit may commit (``committable``).
EXTENSIBLE_KV_CACHE_COMMITTABLE_BLOCKS = Hook(
    ("vllm.v1.worker.extensible_kv_cache",), "ExtensibleKVCache.committable_blocks", ("self",), versions=">=0.34"
)
EXTENSIBLE_KV_CACHE_BLOCKS_WITHIN = Hook(
    ("vllm.v1.worker.extensible_kv_cache",), "ExtensibleKVCache.blocks_within", ("self", "num_bytes"), versions=">=0.34"
)
# Called, not wrapped: the layout named where it gets no chunk plan (``_give_plan``).
CACHE_CONFIG_GET_RESOLVED_KV_CACHE_LAYOUT = Hook(
    ("vllm.config.cache",), "CacheConfig.get_resolved_kv_cache_layout", ("self",), versions=">=0.34"
)
EXTENSIBLE_KV_CACHE_PHYSICAL_BYTES_FOR = Hook(
    ("vllm.v1.worker.extensible_kv_cache",),
    "ExtensibleKVCache.physical_bytes_for",
    ("self", "num_blocks"),
    versions=">=0.34",
)

# Called, not wrapped: what needs the cache's whole mapping (``refusal``).
KV_TRANSFER_REGISTERS_MEMORY = Hook(
    ("vllm.config.kv_transfer",), "KVTransferConfig.registers_kv_cache_memory", ("self",), versions=">=0.34"
)
KV_TRANSFER_HAS_CONNECTOR = Hook(
    ("vllm.config.kv_transfer",), "KVTransferConfig.has_connector", ("self", "connector_name"), versions=">=0.34"
)

HOOKS = (
    EXTEND_KV_CACHE,
    MEASURE_KV_CACHE_BLOCKS,
    EXTENSIBLE_KV_CACHE_COMMIT,
    EXTENSIBLE_KV_CACHE_PHYSICAL_BYTES_FOR,
    EXTENSIBLE_KV_CACHE_COMMITTABLE_BLOCKS,
    EXTENSIBLE_KV_CACHE_BLOCKS_WITHIN,
    CACHE_CONFIG_GET_RESOLVED_KV_CACHE_LAYOUT,
    KV_TRANSFER_REGISTERS_MEMORY,
    KV_TRANSFER_HAS_CONNECTOR,
)

TARGETS = {"vllm.v1.worker.extensible_kv_cache": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
