"""vllm.v1.engine.core: the utility methods the clients call, and the release
of the pages of blocks above the limit between steps.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.devices import instance_devices
from vllm_kv_cache_limit.hooks.runtime import (
    autoscaler,
    committable,
    engine_entry,
    shared_budget,
    utility_methods,
    wakeups,
)
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, RESIZE_UPSTREAM, optional, require_hooks
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit, allocation_of
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import autoscale_policy, limit_math
from vllm_kv_cache_limit.logic.autoscale_policy import (
    Hysteresis,
    Policy,
    device_bytes_per_block,
    lazy_release,
    shrink_after_s,
)
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError, KVCacheResizeError
from vllm_kv_cache_limit.logic.sizes import format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def patch(module: Any) -> None:
    """Why: the limit lives in the scheduler, in the engine-core process, and
    vLLM's clients reach that process through ``call_utility(name, ...)``,
    which calls an ``EngineCore`` method by name. How: adds two methods."""

    def apply() -> None:
        module.EngineCore.kv_cache_limit_set = utility_methods.kv_cache_limit_set
        module.EngineCore.kv_cache_limit_status = utility_methods.kv_cache_limit_status
        module.EngineCore.kv_cache_limit_announce = engine_entry.set_status_url

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
        limit = utility_methods.limit_of(self)
        if limit is None:
            return original(self, *args, **kwargs)
        state = EngineCoreState.of(self)
        if state.in_step:
            return original(self, *args, **kwargs)
        state.in_step = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            state.in_step = False
        _between_steps(self, limit)
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
        if utility_methods.autoscaler_of(self) is not None and not EngineCoreState.of(self).in_step:
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
    ``EngineCore.shutdown`` to remove the engine core's announcement
    (``hooks.engine_entry``) and stop the autoscaler before the original tears
    the engine down, and its ledger entries after, once the workers' memory
    they count is gone; an orphaned engine core's workers are killed first
    (``wakeups.start_waking``), and its entries go as soon as they have
    exited (``wakeups.wait_exited``), not once vLLM's executor has seen it.
    Without either the original runs alone."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            engine_entry.stop(self)
        except Exception:  # never in the way of vLLM's own shutdown
            logger.exception("Removing this instance's entry from the lock folder failed; the process exit drops it.")
        state = EngineCoreState.peek(self)
        scaler = None if state is None else state.autoscaler
        to_leave = False  # its ledger, once the workers' memory is gone
        if state is not None and scaler is not None:
            state.autoscaler = None
            try:
                to_leave = shared_budget.stop(scaler, state.lock, SHUTDOWN_WAIT_S)
            except Exception:  # never in the way of vLLM's own shutdown
                logger.exception("Stopping KV cache autoscaling failed; the process exit drops its ledger entries.")
            try:
                if scaler.orphaned:  # nobody can reach its workers; vLLM would give a busy one 10 s
                    children = wakeups.end_children()
                    ended = ", ".join(str(child.pid) for child in children) or "none"
                    logger.info("KV cache autoscale: ended the workers (pids %s) of this orphaned engine core.", ended)
                    # Their memory is gone once they have exited; vLLM's
                    # executor may see that seconds later, or never.
                    if to_leave and wakeups.wait_exited(children, wakeups.WORKERS_EXIT_S):
                        to_leave = not _leave(scaler, "its workers have exited")
            except Exception:  # never in the way of vLLM's own shutdown, which ends them too
                logger.exception("Ending the workers of this orphaned engine core failed; vLLM's shutdown ends them.")
        try:
            return original(self, *args, **kwargs)
        finally:
            # The entries go once the workers' memory has (their executor is
            # shut down): the ledger never says less than they commit.
            if scaler is not None and to_leave:
                _leave(scaler, "the engine core shut down")

    return method


def _leave(scaler: Autoscaler, why: str) -> bool:
    """Leave the shared budget's ledger (``scaler.close()``); whether it worked."""
    try:
        scaler.close()
    except Exception:
        logger.exception("Leaving the shared KV cache budget's ledger failed; the process exit drops it.")
        return False
    logger.debug("KV cache autoscale off: %s; its ledger entries are removed.", why)
    return True


def _between_steps(engine_core: Any, limit: RuntimeLimit | None = None) -> None:
    """What an engine core does between steps: the autoscaler's decision,
    then the release of the pages above the limit once it holds. ``limit``:
    the engine core's, when the caller has it already (one per block pool)."""
    limit = limit if limit is not None else utility_methods.limit_of(engine_core)
    if limit is None:
        return
    scaler = utility_methods.autoscaler_of(engine_core)
    if scaler is not None:
        # A release due first, so that the decision's ledger entry falls to
        # what the workers hold after it, never before the memory goes.
        limit.release_if_due()
        scaler.tick(engine_core, limit)
    limit.release_if_due()


def start_autoscaling(self: Any, reservation: shared_budget.Reservation | None = None) -> None:
    """With ``--kv-cache-autoscale``: once the KV cache is allocated (the
    start-up lock still held), set the limit to the floor and return the
    pages above it to the OS, so the next instance's start-up measures
    memory without them, then join the shared budget's ledger, its entries
    (``reservation``: those that held the start-up allocation) falling to
    what the workers still commit."""
    vllm_config = self.vllm_config
    cache_config = vllm_config.cache_config
    if not getattr(cache_config, autoscaler.AUTOSCALE, False):
        return
    try:
        require_hooks()
    except KVCacheResizeError as exc:
        raise KVCacheMaxMemoryError(f"--kv-cache-autoscale cannot work in this vLLM: {exc}") from None
    allocation = allocation_of(self)
    floor = autoscale_policy.floor_blocks(getattr(cache_config, autoscaler.MIN_MEMORY), allocation)
    groups = []
    for group in self.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append((spec.block_size, -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)))
    scaler = Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(floor, allocation.blocks_per_request, shrink_after_s())),
        ceiling=allocation.num_blocks,
        set_limit=functools.partial(utility_methods.set_limit, log=False),
        committable=committable.committable_of,
        group_caps=groups,
        max_model_len=allocation.max_model_len,
        budget=getattr(cache_config, autoscaler.SHARED_BUDGET),
        lazy_release=lazy_release(),
    )
    bpb = allocation.bytes_per_block
    # The floor first, its pages above returned, then the ledger: its entry
    # holds what the workers still commit from its first write.
    reply = utility_methods.set_limit(self, floor * bpb, "drain", log=False)
    if limit_math.is_error(reply):
        raise KVCacheMaxMemoryError(f"--kv-cache-autoscale could not set the limit to its floor: {reply['error']}")
    limit = utility_methods.limit_of(self)
    assert limit is not None
    scaler.held = floor
    if scaler.budget is not None:
        devices, workers = instance_devices(vllm_config)
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        scaler.device_bytes_per_block = device_bytes_per_block(allocation, len(devices), workers, cpu)
        shared_budget.join(
            scaler,
            [(d.key, d.label) for d in devices],
            committed=functools.partial(_held, limit),
            reservation=reservation,
        )
        _hold_in_workers(self, scaler)
    state = EngineCoreState.of(self)
    state.autoscaler = scaler
    logger.info(
        "KV cache autoscale on: limit %s per worker (the floor, %d of %d blocks), at most %s; a range of %s (the "
        "blocks above the floor) returned to the OS before the next instance's start-up lock is granted "
        "(this instance's start-up peak was its whole "
        "allocation, %s)%s.",
        format_size(floor * bpb),
        floor,
        allocation.num_blocks,
        format_size(allocation.nbytes),
        format_size(limit.released_bytes if limit else 0),
        format_size(allocation.nbytes),
        scaler._budget_text(),
    )
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc

    if isinstance(self, EngineCoreProc):  # an idle engine core blocks on its input queue: wake it
        wakeups.start_waking(self, scaler, EngineCoreRequestType.WAKEUP)
    else:  # in the caller's process: it steps only while the caller calls it
        state.lock = threading.RLock()
        wakeups.start_deciding(scaler, state.lock, functools.partial(_decide_between_calls, self))


def _hold_in_workers(engine_core: Any, scaler: Autoscaler) -> None:
    """Have each worker hold a companion of this instance's ledger entries
    (``WorkerBase.kv_cache_limit_hold_entries``): an engine core killed
    before its workers (a SIGKILL of the process group) then leaves the
    entries counted until the workers, and their memory, are gone. Not
    fatal: without them, the entries go with the engine core."""
    entries = [(ledger.folder, ledger.key, ledger.entry_name) for ledger in scaler.ledgers if ledger.entry_name]
    if not entries:
        return
    try:
        held = engine_core.model_executor.collective_rpc("kv_cache_limit_hold_entries", args=(entries,))
    except Exception as exc:
        logger.warning(
            "KV cache autoscale: the workers could not hold companions of this instance's ledger entries (%r); "
            "if the engine core dies before its workers, its entries go before their memory does.",
            exc,
        )
        return
    logger.debug("KV cache autoscale: the workers hold %s companions of the ledger entries %s.", held, entries)


def _held(limit: RuntimeLimit) -> int:
    """Blocks the workers may commit under ``limit`` once a release due
    is tried (a failed one is tried again at the next call)."""
    limit.release_if_due()
    return max(limit.limit, limit.committed)


def _decide_between_calls(engine_core: Any) -> None:
    """A decision of an in-process engine core's timer, the engine core's
    lock held: no call of the client is in progress."""
    if not EngineCoreState.of(engine_core).in_step:  # a step called other than through the client
        _between_steps(engine_core)


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

# Called, not wrapped: a KV cache group's blocks per request (``_read_allocation``, ``start_autoscaling``).
KV_CACHE_SPEC_MAX_MEMORY_USAGE_BYTES = Hook(
    ("vllm.v1.kv_cache_interface",), "KVCacheSpec.max_memory_usage_bytes", ("self", "vllm_config")
)

# Called, not wrapped: the status's running and waiting requests (``utility_methods.request_counts``;
# None where it fails).
SCHEDULER_GET_REQUEST_COUNTS = Hook(("vllm.v1.core.sched.scheduler",), "Scheduler.get_request_counts", ("self",))

HOOKS = (
    ENGINE_CORE,
    ENGINE_CORE_STEP,
    ENGINE_CORE_STEP_WITH_BATCH_QUEUE,
    ENGINE_CORE_ABORT_REQUESTS,
    ENGINE_CORE_PROC_HANDLE_CLIENT_REQUEST,
    ENGINE_CORE_SHUTDOWN,
    KV_CACHE_SPEC_MAX_MEMORY_USAGE_BYTES,
    SCHEDULER_GET_REQUEST_COUNTS,
)

TARGETS = {"vllm.v1.engine.core": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
