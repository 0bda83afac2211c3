"""The engine core's utility methods that vLLM's clients call by name
(``call_utility``): ``kv_cache_limit_set`` and ``kv_cache_limit_status``,
and the one place that sets the run-time limit on an engine core
(``set_limit``: manual resizes, the autoscaler, a start at 0.34's committed
blocks). ``hooks.runtime.engine_core`` adds them to vLLM's ``EngineCore``.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.hooks.runtime import committable, extensible_kv_cache
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.availability import require_hooks
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit, allocation_of, pages_of
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError, KVCacheResizeError
from vllm_kv_cache_limit.logic.sizes import format_size, suggest_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def autoscaler_of(engine_core: Any) -> Autoscaler | None:
    """The engine core's autoscaler, once started (``--kv-cache-autoscale``)."""
    state = EngineCoreState.peek(engine_core)
    return None if state is None else state.autoscaler


def limit_of(engine_core: Any) -> RuntimeLimit | None:
    """The run-time limit on an engine core's block pool, if one was set."""
    manager = getattr(engine_core.scheduler, "kv_cache_manager", None)  # None: a model without KV cache
    return None if manager is None else RuntimeLimit.of(manager.block_pool)


def pool_of(engine_core: Any) -> Any:
    """The engine core's block pool (its KV cache manager's)."""
    return engine_core.scheduler.kv_cache_manager.block_pool


def kv_cache_limit_set(self: Any, nbytes: int, mode: str) -> dict[str, Any]:
    """Apply a new limit of ``nbytes`` per worker; returns the status at once
    (the client polls until it holds). Errors come back as ``{"error": ...}``
    so that the client raises them with their message. While autoscaling,
    ``nbytes`` is the ceiling the autoscaler stays under."""
    scaler = autoscaler_of(self)
    if scaler is None:
        return set_limit(self, nbytes, mode)
    try:
        require_hooks()
        mode = limit_math.parse_mode(mode)
        ceiling = limit_math.limit_for(int(nbytes), scaler.allocation)
        if ceiling < scaler.floor:
            floor = scaler.floor * scaler.allocation.bytes_per_block
            raise KVCacheResizeError(
                f"Cannot set the KV cache limit to {format_size(int(nbytes))} ({nbytes} bytes) while autoscaling: "
                f"it is below the floor, --kv-cache-min-memory {format_size(floor)} ({floor} bytes). Choose a "
                f"size of at least {suggest_size(floor, scaler.allocation.nbytes)}."
            )
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    limit = limit_of(self)
    if limit is not None and limit.limit > ceiling:
        # The limit first: refused or failed, the ceiling stays as it was
        # (all of the change or none of it).
        reply = set_limit(self, ceiling * scaler.allocation.bytes_per_block, mode)
        if limit_math.is_error(reply):
            return reply
    scaler.ceiling = ceiling
    logger.info(
        "KV cache autoscale: ceiling set to %s per worker (%d blocks); the autoscaler stays under it.",
        format_size(int(nbytes)),
        ceiling,
    )
    return kv_cache_limit_status(self)  # with the new ceiling


def set_limit(self: Any, nbytes: int, mode: str, log: bool = True, lazy: bool = False) -> dict[str, Any]:
    """Set the limit to ``nbytes`` per worker (as ``kv_cache_limit_set``
    without autoscaling); the autoscaler logs its own line (``log=False``).
    ``lazy``: the pages above the new limit go back lazily (``MADV_FREE``)
    once it holds, else at once."""
    try:
        require_hooks()
        mode = limit_math.parse_mode(mode)
        pool = pool_of(self)
        limit = RuntimeLimit.of(pool)
        allocation = limit.allocation if limit else allocation_of(self)
        new = limit_math.limit_for(int(nbytes), allocation)
        current = limit.limit if limit else allocation.num_blocks
        if new < current:
            refuse_unreturnable(self, nbytes)
        elif new > current:
            committable.refuse_above(self, int(nbytes), new, current, allocation.bytes_per_block)
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    if limit is None:
        limit = RuntimeLimit.attach(pool, allocation, pages_of(self))
    old_requested = limit.requested
    try:
        old = limit.change(new, int(nbytes), mode, self.scheduler, lazy)
    except Exception as exc:  # restored by ``change``: nothing half applied
        logger.exception(
            "Changing the KV cache limit to %s failed; it stays at %d blocks.", format_size(int(nbytes)), limit.limit
        )
        return {
            "error": (
                f"Changing the KV cache limit to {format_size(int(nbytes))} failed inside vLLM "
                f"({type(exc).__name__}: {exc}); the limit stays at {format_size(old_requested)} ({limit.limit} blocks)."
            ),
            "failed": True,
        }
    if log:
        logger.info(
            "KV cache limit set to %s per worker (%d of %d blocks, %s), mode %s; was %d blocks.",
            format_size(int(nbytes)),
            new,
            allocation.num_blocks,
            format_size(new * allocation.bytes_per_block),
            mode,
            old,
        )
    limit.release_if_due()  # nothing above the limit in use (idle, or all preempted)
    return kv_cache_limit_status(self)


def start_at(engine_core: Any, committed: int) -> None:
    """Start with a run-time limit at the ``committed`` blocks of a block
    pool that covers the cap's reservation (vLLM 0.34's extensible KV cache
    with warmup leaving room for fewer blocks than the cap): the limit can
    grow to the cap later, committing GPU memory as it does."""
    allocation = allocation_of(engine_core)
    reply = set_limit(engine_core, committed * allocation.bytes_per_block, "drain", log=False)
    if limit_math.is_error(reply):
        raise KVCacheMaxMemoryError(
            f"The KV cache could not start at the {committed} blocks committed after warmup: {reply['error']}"
        )


def refuse_unreturnable(engine_core: Any, nbytes: int) -> None:
    """Refuse a lower limit where the workers' extensible KV cache cannot
    give the memory above it back (a feature needs its whole mapping)."""
    reason = extensible_kv_cache.refusal(engine_core.vllm_config)
    if reason is not None:
        raise KVCacheResizeError(
            f"Cannot lower the KV cache limit to {format_size(int(nbytes))} ({nbytes} bytes): {reason}, so the "
            f"GPU memory above the limit could not be returned. {extensible_kv_cache.NO_RETURN_HINT}"
        )


def kv_cache_limit_status(self: Any) -> dict[str, Any]:
    """The limit in force and the blocks in use; only reads (the engine core
    releases the pages itself, ``engine_core._release_after``)."""
    try:
        require_hooks()
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    pool = pool_of(self)
    limit = RuntimeLimit.of(pool)
    if limit is None:  # none set yet: read, attach nothing
        limit = RuntimeLimit.whole(pool, allocation_of(self), pages_of(self))
    in_use, above = limit.usage()
    status = limit_math.status(
        limit.allocation, limit.limit, limit.requested, limit.mode, in_use, above, limit.released_bytes
    )
    running, waiting = request_counts(self.scheduler)
    status.update(num_requests_running=running, num_requests_waiting=waiting, last_change_at=limit.changed_at)
    most = committable.most_blocks(self, limit.limit)
    status["kv_cache_committable_bytes"] = None if most is None else most * limit.allocation.bytes_per_block
    scaler = autoscaler_of(self)
    status["autoscale"] = None if scaler is None else scaler.status()
    return status


def request_counts(scheduler: Any) -> tuple[int | None, int | None]:
    """Requests the scheduler runs and keeps waiting (None where it cannot say)."""
    try:
        running, waiting = scheduler.get_request_counts()
        return int(running), int(waiting)
    except Exception:
        return None, None
