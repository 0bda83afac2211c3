"""vllm.v1.engine.core: the utility methods the clients call, and the release
of the pages of blocks above the limit between steps.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.devices import instance_devices
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, RESIZE_UPSTREAM, optional, require_hooks
from vllm_kv_cache_limit.hooks.runtime.block_pool import Limit
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.autoscale_policy import Policy, Scaler, device_bytes_per_block, shrink_after_s
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError, KVCacheResizeError
from vllm_kv_cache_limit.logic.limit_math import Allocation
from vllm_kv_cache_limit.logic.sizes import format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def patch(module: Any) -> None:
    """Why: the limit lives in the scheduler, in the engine-core process, and
    vLLM's clients reach that process through ``call_utility(name, ...)``,
    which calls an ``EngineCore`` method by name. How: adds two methods."""

    def apply() -> None:
        module.EngineCore.kv_cache_limit_set = _kv_cache_limit_set
        module.EngineCore.kv_cache_limit_status = _kv_cache_limit_status
        module.EngineCore.kv_cache_limit_autoscale_start = _autoscale_start

    optional(ENGINE_CORE, apply)
    for hook in (ENGINE_CORE_STEP, ENGINE_CORE_STEP_WITH_BATCH_QUEUE, ENGINE_CORE_ABORT_REQUESTS):
        name = hook.qualname.rpartition(".")[2]
        optional(hook, functools.partial(wrap, module.EngineCore, name, _release_after))
    optional(
        ENGINE_CORE_PROC_HANDLE_CLIENT_REQUEST,
        functools.partial(wrap, module.EngineCoreProc, "_handle_client_request", _autoscale_after_request),
    )
    optional(ENGINE_CORE_SHUTDOWN, functools.partial(wrap, module.EngineCore, "shutdown", _leave_budget_first))


def _release_after(original: Callable) -> Callable:
    """Why: the pages of the blocks above a lowered limit go back to the OS
    once none of them is in use, whoever is or is not polling. How: wraps
    ``EngineCore.step`` (and ``step_with_batch_queue``, ``abort_requests``:
    blocks are freed as requests finish in a step or are aborted between
    steps) to release them after the original returns, between steps; an
    abort processed inside a step leaves it to that step. Without a limit
    the original runs alone."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _limit_of(self) is None or getattr(self, "_kvcl_in_step", False):
            return original(self, *args, **kwargs)
        self._kvcl_in_step = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            self._kvcl_in_step = False
        _between_steps(self)
        return result

    return method


def _autoscale_after_request(original: Callable) -> Callable:
    """Why: an idle engine core blocks on its input queue and takes no step,
    yet an autoscaled limit must fall while it idles and rise as soon as a
    request arrives. How: wraps ``EngineCoreProc._handle_client_request``
    (which also gets the ``WAKEUP`` the autoscaler's timer puts in the
    queue) to let the autoscaler decide after the original, in the engine
    core's own thread, between steps. Without autoscaling the original runs
    alone."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if getattr(self, "_kvcl_autoscaler", None) is not None and not getattr(self, "_kvcl_in_step", False):
            _between_steps(self)
        return result

    return method


SHUTDOWN_WAIT_S = 5.0
"""Seconds a shutdown waits for a decision in progress (a ledger write, a
release of pages) before it goes on without it."""


def _leave_budget_first(original: Callable) -> Callable:
    """Why: an engine shut down in a process that goes on (``del llm`` in a
    notebook, an in-process engine) would keep its ledger entry, and with it
    its share of the shared budget, until that process exits; a clean exit
    would leave its entry file for the next reader to remove. How: wraps
    ``EngineCore.shutdown`` to stop the autoscaler and remove its entries
    before the original tears the engine down. Without autoscaling the
    original runs alone."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        scaler: Autoscaler | None = getattr(self, "_kvcl_autoscaler", None)
        if scaler is not None:
            self._kvcl_autoscaler = None
            try:
                left = _leave_budget(self, scaler)
            except Exception:  # never in the way of vLLM's own shutdown
                logger.exception("Leaving the shared KV cache budget's ledger failed; the process exit drops it.")
            else:
                if left:
                    logger.debug("KV cache autoscale off: the engine core shuts down; its ledger entries are removed.")
        return original(self, *args, **kwargs)

    return method


def _leave_budget(engine_core: Any, scaler: Autoscaler) -> bool:
    """Stop the autoscaler and leave its ledgers; whether it left them now.
    An in-process engine core's timer may be deciding (vLLM's finalizer
    calls shutdown without the client's lock): it starts no other decision,
    and this one may end within ``SHUTDOWN_WAIT_S``. One that does not keeps
    its ledger's descriptors (it may still write through them), and the
    timer closes them as it ends."""
    scaler.stop.set()
    lock = getattr(engine_core, autoscaler.ENGINE_LOCK, None)
    if lock is None:
        scaler.close()
        return True
    if lock.acquire(timeout=SHUTDOWN_WAIT_S):
        try:
            scaler.close()
        finally:
            lock.release()
        return True
    scaler.close_when_stopped = True
    timer = scaler.timer
    if timer is not None:
        timer.join(timeout=0.5)
    if timer is None or not timer.is_alive():
        scaler.close()
        return True
    logger.warning(
        "An autoscaling decision is still in progress after %g s; the engine core shuts down, and its shared "
        "budget's ledger entries go when the decision ends (or the process exits).",
        SHUTDOWN_WAIT_S,
    )
    return False


def _between_steps(engine_core: Any) -> None:
    """What an engine core does between steps: the autoscaler's decision,
    then the release of the pages above the limit once it holds."""
    _autoscale_tick(engine_core)
    _release_if_due(engine_core)


def _autoscale_tick(engine_core: Any) -> None:
    scaler: Autoscaler | None = getattr(engine_core, "_kvcl_autoscaler", None)
    state = _limit_of(engine_core)
    if scaler is not None and state is not None:
        scaler.tick(engine_core, state)


def _limit_of(engine_core: Any) -> Limit | None:
    """The run-time limit on an engine core's block pool, if one was set."""
    manager = getattr(engine_core.scheduler, "kv_cache_manager", None)  # None: a model without KV cache
    return None if manager is None else getattr(manager.block_pool, "_kvcl_limit", None)


def _release_if_due(engine_core: Any) -> None:
    """Return the pages of the blocks above the limit to the OS (through the
    workers) once none of them is in use; a failure is logged, never raised
    into vLLM's step, and the pages then stay allocated."""
    state = _limit_of(engine_core)
    if state is None or not state.release_due():
        return
    num_blocks = state.allocation.num_blocks
    try:
        state.released_bytes = _worker_pages(engine_core, state.limit, num_blocks, release=True)
    except Exception:
        state.released_bytes = 0
        logger.exception(
            "Returning the KV cache pages of blocks %d-%d to the OS failed; they stay allocated.",
            state.limit,
            num_blocks - 1,
        )
    state.released_from = state.limit
    logger.info(
        "KV cache limit holds: %s of blocks %d-%d returned to the OS.",
        format_size(state.released_bytes),
        state.limit,
        num_blocks - 1,
    )


def _allocation(engine_core: Any) -> Allocation:
    """The start-up allocation, read once per engine (it asks the workers)."""
    pool = _pool(engine_core)
    allocation: Allocation | None = getattr(pool, "_kvcl_allocation", None)
    if allocation is None:
        allocation = pool._kvcl_allocation = _read_allocation(engine_core)
    return allocation


def _read_allocation(engine_core: Any) -> Allocation:
    config = engine_core.scheduler.kv_cache_config
    vllm_config = engine_core.vllm_config
    num_blocks = config.num_blocks
    # What each worker really holds (the distinct storages of its KV cache
    # tensors): the config's tensors can share one allocation (hybrid models).
    allocated = [int(b) for b in engine_core.model_executor.collective_rpc("kv_cache_limit_allocated")]
    per_request = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_request += -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
    return Allocation(
        num_blocks=num_blocks,
        bytes_per_block=min(allocated) // num_blocks,
        blocks_per_request=per_request,
        max_model_len=vllm_config.model_config.max_model_len,
        largest_bytes_per_block=-(-max(allocated) // num_blocks),
    )


def _pool(engine_core: Any) -> Any:
    return engine_core.scheduler.kv_cache_manager.block_pool


def _kv_cache_limit_set(self: Any, nbytes: int, mode: str) -> dict[str, Any]:
    """Apply a new limit of ``nbytes`` per worker; returns the status at once
    (the client polls until it holds). Errors come back as ``{"error": ...}``
    so that the client raises them with their message. While autoscaling,
    ``nbytes`` is the ceiling the autoscaler stays under."""
    scaler: Autoscaler | None = getattr(self, "_kvcl_autoscaler", None)
    if scaler is None:
        return _set_limit(self, nbytes, mode)
    try:
        require_hooks()
        mode = limit_math.parse_mode(mode)
        ceiling = limit_math.limit_for(int(nbytes), scaler.allocation)
        if ceiling < scaler.floor:
            floor = scaler.floor * scaler.allocation.bytes_per_block
            raise KVCacheResizeError(
                f"Cannot set the KV cache limit to {format_size(int(nbytes))} ({nbytes} bytes) while autoscaling: "
                f"it is below the floor, --kv-cache-min-memory {format_size(floor)} ({floor} bytes). Choose a "
                f"size of at least {format_size(floor)}."
            )
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    state = _limit_of(self)
    if state is not None and state.limit > ceiling:
        # The limit first: refused or failed, the ceiling stays as it was
        # (all of the change or none of it).
        reply = _set_limit(self, ceiling * scaler.allocation.bytes_per_block, mode)
        if limit_math.is_error(reply):
            return reply
    scaler.ceiling = ceiling
    logger.info(
        "KV cache autoscale: ceiling set to %s per worker (%d blocks); the autoscaler stays under it.",
        format_size(int(nbytes)),
        ceiling,
    )
    return _kv_cache_limit_status(self)  # with the new ceiling


def _set_limit(self: Any, nbytes: int, mode: str, log: bool = True) -> dict[str, Any]:
    """Set the limit to ``nbytes`` per worker (as ``kv_cache_limit_set``
    without autoscaling); the autoscaler logs its own line (``log=False``)."""
    try:
        require_hooks()
        mode = limit_math.parse_mode(mode)
        pool = _pool(self)
        state: Limit | None = getattr(pool, "_kvcl_limit", None)
        allocation = state.allocation if state else _allocation(self)
        new = limit_math.limit_for(int(nbytes), allocation)
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    if state is None:
        state = Limit(allocation=allocation, limit=allocation.num_blocks, requested=allocation.nbytes)
        pool._kvcl_limit = state
    old, old_requested, old_mode = state.limit, state.requested, state.mode
    state.limit, state.requested, state.mode = new, int(nbytes), mode
    try:
        if new < old:
            _shrink(self, pool, state)
        elif new > old:
            _grow(self, pool, state)
    except Exception as exc:
        # A failure inside vLLM (preempting, the workers' reply) must not
        # leave a half-applied limit: the old one is restored. Requests
        # preempted before the failure are recomputed, as any preempted one.
        state.limit, state.requested, state.mode = old, old_requested, old_mode
        _settle(pool, state)
        logger.exception(
            "Changing the KV cache limit to %s failed; it stays at %d blocks.", format_size(int(nbytes)), old
        )
        return {
            "error": (
                f"Changing the KV cache limit to {format_size(int(nbytes))} failed inside vLLM "
                f"({type(exc).__name__}: {exc}); the limit stays at {format_size(old_requested)} ({old} blocks)."
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
    _release_if_due(self)  # nothing above the limit in use (idle, or all preempted)
    return _kv_cache_limit_status(self)


def _shrink(engine_core: Any, pool: Any, state: Limit) -> None:
    above = pool.blocks[state.limit :]
    if pool.enable_caching:
        # Prefix-cache entries in blocks above the limit go now, in use or not,
        # so no new request can hit (and hold) them.
        for block in above:
            if not block.is_null:
                pool._maybe_evict_cached_block(block)
    state.withhold(pool, above)
    if state.mode == "preempt":
        _preempt_above(engine_core.scheduler, state.limit)


def _preempt_above(scheduler: Any, limit: int) -> None:
    """Preempt the running requests holding a block at or above ``limit``,
    as vLLM's ``reset_prefix_cache(reset_running_requests=True)`` does for
    all of them: they go back to the waiting queue and are recomputed."""
    manager = scheduler.kv_cache_manager
    victims = [
        request
        for request in scheduler.running
        if any(b >= limit for group in manager.get_blocks(request.request_id).get_block_ids() for b in group)
    ]
    timestamp = time.monotonic()
    extra = {"drop_stale_output": True} if _preempt_drops_stale_output() else {}
    for request in reversed(victims):
        scheduler.running.remove(request)
        scheduler._preempt_request(request, timestamp, **extra)
        # vLLM 0.29-0.33 keep last step's ids apart and drop them when they
        # preempt (0.32 reset_prefix_cache); 0.34's _preempt_request records
        # the preemption itself (reset_preempted_req_ids).
        previous = getattr(scheduler, "prev_step_scheduled_req_ids", None)
        if previous is not None:
            previous.discard(request.request_id)
    if victims:
        logger.info("Preempted %d running request(s) holding blocks above the new KV cache limit.", len(victims))


@functools.cache
def _preempt_drops_stale_output() -> bool:
    """Whether this vLLM's ``Scheduler._preempt_request`` takes
    ``drop_stale_output`` (0.32+; a preempted request's output of the step
    in flight is then dropped), read once from its signature as
    ``compat.RESIZE_HOOKS`` resolves it: never by trying a call, which could
    preempt twice."""

    preempt, problem = compat.resolve_hook(SCHEDULER_PREEMPT_REQUEST)
    if preempt is None:
        raise KVCacheResizeError(f"Run-time KV cache resize is unavailable in this vLLM: {problem}")
    return "drop_stale_output" in inspect.signature(preempt).parameters  # type: ignore[arg-type]


def _give_back(pool: Any, state: Limit) -> None:
    """Queue the withheld blocks below the limit again."""
    back = sorted(i for i in state.withheld if i < state.limit)
    pool.free_block_queue.append_n([pool.blocks[i] for i in back])
    state.withheld.difference_update(back)


def _settle(pool: Any, state: Limit) -> None:
    """Make the free queue match ``state.limit`` again (after a failed
    change): withheld blocks below it queued, free blocks at or above it
    withheld. Touches only free blocks, so it cannot fail on a request."""
    _give_back(pool, state)
    state.withhold(pool, pool.blocks[state.limit :])


def _grow(engine_core: Any, pool: Any, state: Limit) -> None:
    _give_back(pool, state)
    if state.released_from is not None and state.released_from < state.limit:
        state.released_bytes = _worker_pages(engine_core, state.limit, state.allocation.num_blocks, release=False)
        state.released_from = state.limit if state.released_bytes else None


def _kv_cache_limit_status(self: Any) -> dict[str, Any]:
    """The limit in force and the blocks in use; only reads (the engine core
    releases the pages itself, see ``_release_after``)."""
    try:
        require_hooks()
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    pool = _pool(self)
    state: Limit | None = getattr(pool, "_kvcl_limit", None)
    if state is None:
        allocation = _allocation(self)
        state = Limit(allocation=allocation, limit=allocation.num_blocks, requested=allocation.nbytes)
    num_blocks = state.allocation.num_blocks
    free = pool.get_num_free_blocks()
    in_use = num_blocks - limit_math.NULL_BLOCKS - free - len(state.withheld)
    above = sum(1 for block in pool.blocks[state.limit :] if block.ref_cnt > 0 and not block.is_null)
    status = limit_math.status(
        state.allocation, state.limit, state.requested, state.mode, in_use, above, state.released_bytes
    )
    scaler: Autoscaler | None = getattr(self, "_kvcl_autoscaler", None)
    status["autoscale"] = None if scaler is None else scaler.status()
    return status


def _autoscale_start(self: Any) -> None:
    """With ``--kv-cache-autoscale``: once the KV cache is allocated (the
    start-up lock still held), take a place in the shared budget's ledger,
    set the limit to the floor and return the pages above it to the OS, so
    the next instance's start-up measures memory without them."""
    vllm_config = self.vllm_config
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, autoscaler.AUTOSCALE, False):
        return
    try:
        require_hooks()
    except KVCacheResizeError as exc:
        raise KVCacheMaxMemoryError(f"--kv-cache-autoscale cannot work in this vLLM: {exc}") from None
    allocation = _allocation(self)
    floor = autoscaler.floor_blocks(getattr(cache_config, autoscaler.MIN_MEMORY), allocation)
    groups = []
    for group in self.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append((spec.block_size, -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)))
    scaler = Autoscaler(
        allocation=allocation,
        scaler=Scaler(Policy(floor, allocation.blocks_per_request, shrink_after_s())),
        ceiling=allocation.num_blocks,
        set_limit=functools.partial(_set_limit, log=False),
        group_caps=groups,
        max_model_len=allocation.max_model_len,
        budget=getattr(cache_config, autoscaler.SHARED_BUDGET),
    )
    bpb = allocation.bytes_per_block
    if scaler.budget is not None:
        devices, workers = instance_devices(vllm_config)
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        scaler.device_bytes_per_block = device_bytes_per_block(allocation, len(devices), workers, cpu)
        autoscaler.join(scaler, [(d.key, d.label) for d in devices])
    reply = _set_limit(self, floor * bpb, "drain", log=False)
    if limit_math.is_error(reply):
        scaler.close()
        raise KVCacheMaxMemoryError(f"--kv-cache-autoscale could not set the limit to its floor: {reply['error']}")
    scaler.held = floor
    self._kvcl_autoscaler = scaler
    state = _limit_of(self)
    logger.info(
        "KV cache autoscale on: limit %s per worker (the floor, %d of %d blocks), at most %s; %s returned to the "
        "OS before the next instance's start-up lock is granted (this instance's start-up peak was its whole "
        "allocation, %s)%s.",
        format_size(floor * bpb),
        floor,
        allocation.num_blocks,
        format_size(allocation.nbytes),
        format_size(state.released_bytes if state else 0),
        format_size(allocation.nbytes),
        scaler._budget_text(),
    )
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    if isinstance(self, EngineCoreProc):  # an idle engine core blocks on its input queue: wake it
        autoscaler.start_waking(self, scaler, EngineCoreRequestType.WAKEUP)
    else:  # in the caller's process: it steps only while the caller calls it
        lock = threading.RLock()
        setattr(self, autoscaler.ENGINE_LOCK, lock)
        autoscaler.start_deciding(scaler, lock, functools.partial(_decide_between_calls, self))


def _decide_between_calls(engine_core: Any) -> None:
    """A decision of an in-process engine core's timer, the engine core's
    lock held: no call of the client is in progress."""
    if not getattr(engine_core, "_kvcl_in_step", False):  # a step called other than through the client
        _between_steps(engine_core)


def _worker_pages(engine_core: Any, keep: int, num_blocks: int, release: bool) -> int:
    results = engine_core.model_executor.collective_rpc("kv_cache_limit_pages", args=(keep, num_blocks, release))
    return sum(int(r) for r in results)


ENGINE_CORE = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore",
    wrapper=patch,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ENGINE_CORE_STEP = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore.step",
    ("self",),
    wrapper=_release_after,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ENGINE_CORE_STEP_WITH_BATCH_QUEUE = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore.step_with_batch_queue",
    ("self",),
    wrapper=_release_after,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ENGINE_CORE_ABORT_REQUESTS = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore.abort_requests",
    ("self", "request_ids"),
    wrapper=_release_after,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ENGINE_CORE_PROC_HANDLE_CLIENT_REQUEST = Hook(
    ("vllm.v1.engine.core",),
    "EngineCoreProc._handle_client_request",
    ("self", "request_type", "request"),
    wrapper=_autoscale_after_request,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ENGINE_CORE_SHUTDOWN = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore.shutdown",
    ("self",),
    wrapper=_leave_budget_first,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

FREE_BLOCK_QUEUE_APPEND_N = Hook(("vllm.v1.core.kv_cache_utils",), "FreeKVCacheBlockQueue.append_n", ("self",))

SCHEDULER_PREEMPT_REQUEST = Hook(
    ("vllm.v1.core.sched.scheduler",), "Scheduler._preempt_request", ("self", "request", "timestamp")
)

# Called, not wrapped: the blocks a request holds (``_preempt_above``), and
# a KV cache group's blocks per request (``_read_allocation``, ``_autoscale_start``).
KV_CACHE_MANAGER_GET_BLOCKS = Hook(
    ("vllm.v1.core.kv_cache_manager",), "KVCacheManager.get_blocks", ("self", "request_id")
)

KV_CACHE_BLOCKS_GET_BLOCK_IDS = Hook(("vllm.v1.core.kv_cache_manager",), "KVCacheBlocks.get_block_ids", ("self",))

KV_CACHE_SPEC_MAX_MEMORY_USAGE_BYTES = Hook(
    ("vllm.v1.kv_cache_interface",), "KVCacheSpec.max_memory_usage_bytes", ("self", "vllm_config")
)

HOOKS = (
    ENGINE_CORE,
    ENGINE_CORE_STEP,
    ENGINE_CORE_STEP_WITH_BATCH_QUEUE,
    ENGINE_CORE_ABORT_REQUESTS,
    ENGINE_CORE_PROC_HANDLE_CLIENT_REQUEST,
    ENGINE_CORE_SHUTDOWN,
    FREE_BLOCK_QUEUE_APPEND_N,
    SCHEDULER_PREEMPT_REQUEST,
    KV_CACHE_MANAGER_GET_BLOCKS,
    KV_CACHE_BLOCKS_GET_BLOCK_IDS,
    KV_CACHE_SPEC_MAX_MEMORY_USAGE_BYTES,
)

TARGETS = {"vllm.v1.engine.core": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
