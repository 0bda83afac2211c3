"""vLLM glue of the run-time KV cache limit (the arithmetic is in ``resize``).

Where it acts:

* engine core: ``EngineCore.kv_cache_limit_set`` / ``kv_cache_limit_status``,
  reached through vLLM's utility channel (``call_utility``), take blocks above
  the limit out of the scheduler's free block queue;
* block pool: blocks above the limit that requests free are withheld instead
  of queued, and ``get_usage`` is relative to the limit;
* workers: ``kv_cache_limit_pages`` returns the pages of withheld blocks to
  the OS (CPU backend) once none of them is in use;
* API server: ``--enable-kv-cache-resize`` adds ``GET``/``POST
  /kv_cache/max_memory``, guarded by ``--api-key``.

Every hook is optional: one that cannot be applied makes resizing refuse,
naming it, and leaves start-up and the cap alone.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat, resize
from vllm_kv_cache_limit._hooks import _wrap
from vllm_kv_cache_limit.probe import kv_cache_tensors, worker_kv_cache_bytes
from vllm_kv_cache_limit.resize import Allocation, KVCacheResizeError, KVCacheResizeFailed
from vllm_kv_cache_limit.sizes import format_size

logger = init_logger("vllm.plugins.kv_cache_limit")

ENABLE_FLAG = "--enable-kv-cache-resize"
ROUTE = "/kv_cache/max_memory"
POLL_S = 0.05
MADV_DONTNEED = 4  # Linux

unavailable: dict[str, str] = {}
"""Resize hook -> why it could not be applied; resizing then refuses."""


_CALLED = (
    "BlockPool._maybe_evict_cached_block",
    "FreeKVCacheBlockQueue.remove",
    "FreeKVCacheBlockQueue.append_n",
    "Scheduler._preempt_request",
)
"""vLLM functions resizing calls without wrapping them (``compat.RESIZE_HOOKS``)."""
_called_checked = False


def _problem(qualname: str) -> str | None:
    try:
        hook = compat.get_hook(qualname, compat.RESIZE_HOOKS)
    except KeyError:
        return None
    return compat.resolve_hook(hook)[1]


def _optional(qualname: str, apply: Callable[[], None]) -> None:
    """Apply one resize hook; on any failure record it (resizing then refuses
    naming it) and go on: resizing never stops start-up."""
    try:
        problem = _problem(qualname)
        if problem:
            raise LookupError(problem)
        apply()
    except Exception as exc:
        unavailable[qualname] = f"{qualname}: {exc}"
        logger.warning("Run-time KV cache resize is unavailable: %s could not be applied (%s).", qualname, exc)


def _require_hooks() -> None:
    """Refuse, naming each, when a resize hook could not be applied or a
    function or attribute resizing relies on does not fit this vLLM (checked
    once per process: in the engine core, and in the client's process)."""
    global _called_checked
    if not _called_checked:
        _called_checked = True
        for qualname in _CALLED:
            problem = _problem(qualname)
            if problem:
                unavailable[qualname] = f"{qualname}: {problem}"
        for problem in compat.check_attributes_at_startup(compat.RESIZE_ATTRIBUTES):
            unavailable[problem] = problem
    if unavailable:
        raise KVCacheResizeError(
            "Run-time KV cache resize is unavailable in this vLLM: " + "; ".join(sorted(unavailable.values()))
        )


# ---------------------------------------------------------------------------
# vllm.v1.core.block_pool: withhold blocks above the limit
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Limit:
    """The limit in force on one block pool (set on it as ``_kvcl_limit``)."""

    allocation: Allocation
    limit: int
    requested: int
    mode: str = "drain"
    withheld: set[int] = dataclasses.field(default_factory=set)
    released_from: int | None = None
    released_bytes: int = 0

    def withhold(self, pool: Any, blocks: list[Any]) -> None:
        """Take free blocks at or above the limit out of the free queue (and
        the prefix cache), so the scheduler never hands them out."""
        for block in blocks:
            if block.block_id < self.limit or block.ref_cnt != 0 or block.is_null:
                continue
            if block.prev_free_block is None:  # not in the free queue
                continue
            if pool.enable_caching:
                pool._maybe_evict_cached_block(block)
            pool.free_block_queue.remove(block)
            self.withheld.add(block.block_id)

    def release_due(self) -> bool:
        """Whether every block above the limit is withheld (none is in use)
        while their pages have not been returned at this limit yet."""
        above = self.allocation.num_blocks - self.limit
        return above > 0 and self.released_from != self.limit and len(self.withheld) == above


def patch_block_pool(module: Any) -> None:
    """Why: the scheduler allocates from ``BlockPool.free_block_queue``; a
    run-time limit must keep blocks above it out of that queue, also when
    requests free them. How: wraps ``BlockPool.free_blocks`` (and
    ``unpin_blocks`` where present) to withhold freed blocks above the limit,
    and ``get_usage`` to be relative to the limit; without a limit both call
    vLLM's original unchanged. Upstream: none yet (a resizable block pool)."""
    pool = module.BlockPool
    for name in ("free_blocks", "unpin_blocks"):
        if hasattr(pool, name):
            _optional(f"BlockPool.{name}", functools.partial(_wrap, pool, name, _withhold_after))
    _optional("BlockPool.get_usage", functools.partial(_wrap, pool, "get_usage", _usage_under_limit))


def _withhold_after(original: Callable) -> Callable:
    def method(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        limit: _Limit | None = getattr(self, "_kvcl_limit", None)
        if limit is None:
            return original(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        result = original(self, blocks, *args, **kwargs)
        limit.withhold(self, blocks)
        return result

    return method


def _usage_under_limit(original: Callable) -> Callable:
    def get_usage(self: Any) -> float:
        limit: _Limit | None = getattr(self, "_kvcl_limit", None)
        if limit is None:
            return original(self)
        usable = limit.limit - resize.NULL_BLOCKS
        if usable <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.get_num_free_blocks() / usable))

    return get_usage


# ---------------------------------------------------------------------------
# vllm.v1.engine.core: the utility methods the clients call
# ---------------------------------------------------------------------------


def add_engine_core_methods(module: Any) -> None:
    """Why: the limit lives in the scheduler, in the engine-core process, and
    vLLM's clients reach that process through ``call_utility(name, ...)``,
    which calls an ``EngineCore`` method by name. How: adds two methods.
    Upstream: none yet (a resize utility in ``EngineCore``)."""

    def apply() -> None:
        module.EngineCore.kv_cache_limit_set = _kv_cache_limit_set
        module.EngineCore.kv_cache_limit_status = _kv_cache_limit_status

    _optional("EngineCore", apply)
    for name in ("step", "step_with_batch_queue", "abort_requests"):
        _optional(f"EngineCore.{name}", functools.partial(_wrap, module.EngineCore, name, _release_after))


def _release_after(original: Callable) -> Callable:
    """Why: the pages of the blocks above a lowered limit go back to the OS
    once none of them is in use, whoever is or is not polling. How: wraps
    ``EngineCore.step`` (and ``step_with_batch_queue``, ``abort_requests``:
    blocks are freed as requests finish in a step or are aborted between
    steps) to release them after the original returns, between steps; an
    abort processed inside a step leaves it to that step. Without a limit
    the original runs alone. Upstream: none yet (a resizable block pool)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _limit_of(self) is None or getattr(self, "_kvcl_in_step", False):
            return original(self, *args, **kwargs)
        self._kvcl_in_step = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            self._kvcl_in_step = False
        _release_if_due(self)
        return result

    return method


def _limit_of(engine_core: Any) -> _Limit | None:
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
    total = min(int(b) for b in engine_core.model_executor.collective_rpc("kv_cache_limit_allocated"))
    per_request = 0
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_request += -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
    return Allocation(
        num_blocks=num_blocks,
        bytes_per_block=total // num_blocks,
        blocks_per_request=per_request,
        max_model_len=vllm_config.model_config.max_model_len,
    )


def _pool(engine_core: Any) -> Any:
    return engine_core.scheduler.kv_cache_manager.block_pool


def _kv_cache_limit_set(self: Any, nbytes: int, mode: str) -> dict[str, Any]:
    """Apply a new limit of ``nbytes`` per worker; returns the status at once
    (the client polls until it holds). Errors come back as ``{"error": ...}``
    so that the client raises them with their message."""
    try:
        _require_hooks()
        mode = resize.parse_mode(mode)
        pool = _pool(self)
        state: _Limit | None = getattr(pool, "_kvcl_limit", None)
        allocation = state.allocation if state else _allocation(self)
        new = resize.limit_for(int(nbytes), allocation)
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    if state is None:
        state = _Limit(allocation=allocation, limit=allocation.num_blocks, requested=allocation.nbytes)
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


def _shrink(engine_core: Any, pool: Any, state: _Limit) -> None:
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
        scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
    if victims:
        logger.info("Preempted %d running request(s) holding blocks above the new KV cache limit.", len(victims))


@functools.cache
def _preempt_drops_stale_output() -> bool:
    """Whether this vLLM's ``Scheduler._preempt_request`` takes
    ``drop_stale_output`` (0.32+; a preempted request's output of the step
    in flight is then dropped), read once from its signature as
    ``compat.RESIZE_HOOKS`` resolves it: never by trying a call, which could
    preempt twice."""
    import inspect

    preempt, problem = compat.resolve_hook(compat.get_hook("Scheduler._preempt_request", compat.RESIZE_HOOKS))
    if preempt is None:
        raise KVCacheResizeError(f"Run-time KV cache resize is unavailable in this vLLM: {problem}")
    return "drop_stale_output" in inspect.signature(preempt).parameters  # type: ignore[arg-type]


def _give_back(pool: Any, state: _Limit) -> None:
    """Queue the withheld blocks below the limit again."""
    back = sorted(i for i in state.withheld if i < state.limit)
    pool.free_block_queue.append_n([pool.blocks[i] for i in back])
    state.withheld.difference_update(back)


def _settle(pool: Any, state: _Limit) -> None:
    """Make the free queue match ``state.limit`` again (after a failed
    change): withheld blocks below it queued, free blocks at or above it
    withheld. Touches only free blocks, so it cannot fail on a request."""
    _give_back(pool, state)
    state.withhold(pool, pool.blocks[state.limit :])


def _grow(engine_core: Any, pool: Any, state: _Limit) -> None:
    _give_back(pool, state)
    if state.released_from is not None and state.released_from < state.limit:
        state.released_bytes = _worker_pages(engine_core, state.limit, state.allocation.num_blocks, release=False)
        state.released_from = state.limit if state.released_bytes else None


def _kv_cache_limit_status(self: Any) -> dict[str, Any]:
    """The limit in force and the blocks in use; only reads (the engine core
    releases the pages itself, see ``_release_after``)."""
    try:
        _require_hooks()
    except KVCacheResizeError as exc:
        return {"error": str(exc)}
    pool = _pool(self)
    state: _Limit | None = getattr(pool, "_kvcl_limit", None)
    if state is None:
        allocation = _allocation(self)
        state = _Limit(allocation=allocation, limit=allocation.num_blocks, requested=allocation.nbytes)
    num_blocks = state.allocation.num_blocks
    free = pool.get_num_free_blocks()
    in_use = num_blocks - resize.NULL_BLOCKS - free - len(state.withheld)
    above = sum(1 for block in pool.blocks[state.limit :] if block.ref_cnt > 0 and not block.is_null)
    return resize.status(
        state.allocation, state.limit, state.requested, state.mode, in_use, above, state.released_bytes
    )


def _worker_pages(engine_core: Any, keep: int, num_blocks: int, release: bool) -> int:
    results = engine_core.model_executor.collective_rpc("kv_cache_limit_pages", args=(keep, num_blocks, release))
    return sum(int(r) for r in results)


# ---------------------------------------------------------------------------
# vllm.v1.worker.worker_base: give the pages of withheld blocks back
# ---------------------------------------------------------------------------


def add_worker_method(module: Any) -> None:
    """Why: the engine core decides, the workers hold the memory; vLLM's
    ``collective_rpc(name)`` calls a worker method by name. How: adds
    ``WorkerBase.kv_cache_limit_pages``. Upstream: none yet."""

    def apply() -> None:
        module.WorkerBase.kv_cache_limit_pages = kv_cache_limit_pages
        module.WorkerBase.kv_cache_limit_rss_fall = kv_cache_limit_rss_fall
        module.WorkerBase.kv_cache_limit_allocated = worker_kv_cache_bytes

    _optional("WorkerBase", apply)


def kv_cache_limit_pages(self: Any, keep: int, num_blocks: int, release: bool) -> int:
    """Release (``release=True``) the pages of blocks ``[keep, num_blocks)``
    of this worker's KV cache with ``madvise(MADV_DONTNEED)``; they read as
    zeros and come back on the next write. Returns the bytes now released
    from ``keep`` on (0 where the layout or device does not allow it: CUDA
    memory is limited logically, not returned)."""
    spans = []
    for view in kv_cache_tensors(self):
        if view.device.type != "cpu" or view.dim() < 2 or view.shape[0] != num_blocks:
            return 0
        stride = view.stride(0) * view.element_size()
        block_bytes = view[0].numel() * view.element_size()
        spans += resize.block_spans(view.data_ptr(), stride, block_bytes, keep, num_blocks)
    ranges = resize.page_ranges(spans, mmap.PAGESIZE)
    if release:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        rss = _rss_bytes()
        for start, end in ranges:
            if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
                raise OSError(
                    ctypes.get_errno(), f"madvise over the KV cache failed: {os.strerror(ctypes.get_errno())}"
                )
        self._kvcl_rss_fall = rss - _rss_bytes()
        logger.info(
            "KV cache pages of blocks %d-%d released: RSS fell by %d bytes.", keep, num_blocks - 1, self._kvcl_rss_fall
        )
    return sum(end - start for start, end in ranges)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def kv_cache_limit_rss_fall(self: Any) -> int:
    """How far this worker's RSS fell at its last release (measured around
    the ``madvise`` calls, so nothing else the process does counts)."""
    return int(getattr(self, "_kvcl_rss_fall", 0))


# ---------------------------------------------------------------------------
# Clients: LLM and AsyncLLM
# ---------------------------------------------------------------------------


def _client(engine: Any) -> Any:
    _require_hooks()  # the client's attributes too (compat.RESIZE_ATTRIBUTES)
    engine = getattr(engine, "llm_engine", engine)  # LLM -> LLMEngine
    return engine.engine_core


def _call(engine: Any, method: str, *args: Any) -> dict[str, Any]:
    client = _client(engine)
    if hasattr(client, "call_utility"):
        result = client.call_utility(method, *args)
    else:  # InprocClient: the engine core lives in this process
        result = getattr(client.engine_core, method)(*args)
    return _checked(result)


async def _call_async(engine: Any, method: str, *args: Any) -> dict[str, Any]:
    client = _client(engine)
    engines = list(client.core_engines)  # every AsyncLLM client is an MPClient
    if len(engines) < 2:
        return _checked(await client.call_utility_async(method, *args))
    # Data parallel: every engine core has its own scheduler and workers, and
    # vLLM's client sends a utility call to one of them (or to all, keeping
    # the first reply). Each gets the call, and the replies are merged.
    problem = _problem("AsyncMPClient._call_utility_async")
    if problem:
        raise KVCacheResizeError(f"Run-time KV cache resize with data parallel is unavailable in this vLLM: {problem}")

    async def each(call: str, *values: Any) -> list[Any]:
        return await asyncio.gather(*(client._call_utility_async(call, *values, engine=e) for e in engines))

    before = [_checked(s) for s in await each("kv_cache_limit_status")] if method == "kv_cache_limit_set" else []
    replies = await each(method, *args)
    restore = resize.restore_targets(before, replies) if before else []
    if restore:
        # Refused or failed on some engine cores: those that took the change
        # go back to the limit they had, so the engine keeps one limit.
        await asyncio.gather(*(_restore(client, engines, *target) for target in restore))
        refused = [index for index, reply in enumerate(replies) if resize.is_error(reply)]
        worst = max((replies[index] for index in refused), key=lambda reply: bool(reply.get("failed")))
        raise _exception(
            {
                **worst,
                "error": f"{worst['error']} (data-parallel engine cores {refused}; "
                "the others were set back to the limit they had)",
            }
        )
    return resize.merged([_checked(reply) for reply in replies])


async def _restore(client: Any, engines: list[Any], index: int, size: int, mode: str) -> None:
    reply = await client._call_utility_async("kv_cache_limit_set", size, mode, engine=engines[index])
    if resize.is_error(reply):
        logger.warning(
            "Data-parallel engine core %d took the KV cache limit change and could not be set back to %s: %s",
            index,
            format_size(size),
            reply["error"],
        )


def _checked(result: Any) -> dict[str, Any]:
    if resize.is_error(result):
        raise _exception(result)
    return dict(result)


def _exception(reply: dict[str, Any]) -> KVCacheResizeError:
    """The error an engine core's ``{"error": ...}`` reply is raised as."""
    return (KVCacheResizeFailed if reply.get("failed") else KVCacheResizeError)(reply["error"])


def _arguments(size: object, mode: object, timeout_s: object) -> tuple[int, str, float]:
    return resize.parse_target(size), resize.parse_mode(mode), resize.parse_timeout(timeout_s)


def set_kv_cache_max_memory(llm: Any, size: int | str, mode: str = "drain", timeout_s: float = 60.0) -> dict[str, Any]:
    """Change the KV cache limit of a running ``LLM`` (per worker, within
    what it allocated at start-up); returns when the limit holds, or at the
    timeout with the status so far (``holds`` says which)."""
    nbytes, mode, timeout_s = _arguments(size, mode, timeout_s)
    status = _call(llm, "kv_cache_limit_set", nbytes, mode)
    deadline = time.monotonic() + timeout_s
    while not status["holds"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
        status = _call(llm, "kv_cache_limit_status")
    return status


def kv_cache_limit_status(llm: Any) -> dict[str, Any]:
    """The KV cache limit in force on a running ``LLM`` and its blocks."""
    return _call(llm, "kv_cache_limit_status")


async def async_set_kv_cache_max_memory(
    engine: Any, size: int | str, mode: str = "drain", timeout_s: float = 60.0
) -> dict[str, Any]:
    """:func:`set_kv_cache_max_memory` for an ``AsyncLLM``."""
    nbytes, mode, timeout_s = _arguments(size, mode, timeout_s)
    status = await _call_async(engine, "kv_cache_limit_set", nbytes, mode)
    deadline = time.monotonic() + timeout_s
    while not status["holds"] and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        status = await _call_async(engine, "kv_cache_limit_status")
    return status


async def async_kv_cache_limit_status(engine: Any) -> dict[str, Any]:
    """:func:`kv_cache_limit_status` for an ``AsyncLLM``."""
    return await _call_async(engine, "kv_cache_limit_status")


# ---------------------------------------------------------------------------
# vllm.entrypoints: the flag and the HTTP routes
# ---------------------------------------------------------------------------


def patch_server_arg_parser(module: Any) -> None:
    """Why: the resize routes change a live engine, so they are off unless
    the server is started with ``--enable-kv-cache-resize``. How: wraps
    ``make_arg_parser`` to add the flag. Upstream: none yet."""
    _optional("make_arg_parser", functools.partial(_wrap, module, "make_arg_parser", _add_server_flag))


def _add_server_flag(original: Callable) -> Callable:
    def make_arg_parser(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        parser.add_argument(
            ENABLE_FLAG,
            action="store_true",
            default=False,
            help=(
                f"Serve GET and POST {ROUTE} to read and change the KV cache limit of the running engine "
                '(body: {"size": "16M", "mode": "drain" or "preempt"}), within the memory allocated at '
                "start-up. Off by default; the routes honour --api-key."
            ),
        )
        return parser

    return make_arg_parser


def patch_build_app(module: Any) -> None:
    """Why: vLLM's endpoint plugins load only when named in ``VLLM_PLUGINS``
    and warn otherwise; the resize routes follow the server's own flag.
    How: wraps ``build_app`` to include the routes when the flag is set.
    Upstream: none yet."""
    _optional("build_app", functools.partial(_wrap, module, "build_app", _add_routes))


def _add_routes(original: Callable) -> Callable:
    def build_app(args: Any, *rest: Any, **kwargs: Any) -> Any:
        app = original(args, *rest, **kwargs)
        if getattr(args, "enable_kv_cache_resize", False):
            app.include_router(_router(args))
            logger.info("Run-time KV cache resize enabled: GET and POST %s.", ROUTE)
        return app

    return build_app


def _error(status_code: int, message: str, kind: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status_code,
        content={"error": {"message": message, "type": kind, "param": None, "code": status_code}},
    )


_gauge: Any = None


def _limit_gauge() -> Any:
    """``vllm:kv_cache_limit_bytes`` on the server's ``/metrics``: the KV
    cache bytes per worker the limit allows (the start-up cap until the
    first resize or status call)."""
    global _gauge
    if _gauge is None:
        from prometheus_client import Gauge

        _gauge = Gauge(
            "vllm:kv_cache_limit_bytes",
            "KV cache bytes per worker that the run-time limit allows (vllm-kv-cache-limit).",
            multiprocess_mode="mostrecent",
        )
    return _gauge


def _router(args: Any) -> Any:
    import vllm.envs as envs
    from fastapi import APIRouter, Request

    tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
    router = APIRouter()
    gauge = _limit_gauge()
    cap = getattr(args, "kv_cache_max_memory", None)
    if isinstance(cap, int):
        gauge.set(cap)

    def shown(status: dict[str, Any]) -> dict[str, Any]:
        gauge.set(status["kv_cache_limit_bytes"])
        return status

    def authorized(request: Any) -> bool:
        if not tokens:
            return True
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        return AuthenticationMiddleware(None, tokens).verify_token(request.headers)

    async def get_kv_cache_max_memory(request: Request) -> Any:
        if not authorized(request):
            return _error(401, "Unauthorized", "Unauthorized")
        try:
            return shown(await async_kv_cache_limit_status(request.app.state.engine_client))
        except KVCacheResizeError as exc:
            return _error(400, str(exc), "BadRequestError")

    async def set_kv_cache_max_memory_route(request: Request) -> Any:
        if not authorized(request):
            return _error(401, "Unauthorized", "Unauthorized")
        try:
            body = await request.json()
        except ValueError:
            return _error(
                400, 'Invalid body: expected JSON such as {"size": "16M", "mode": "drain"}.', "BadRequestError"
            )
        if not isinstance(body, dict) or "size" not in body:
            return _error(
                400, f'Invalid body {body!r}: expected {{"size": "16M", "mode": "drain"}}.', "BadRequestError"
            )
        try:
            return shown(
                await async_set_kv_cache_max_memory(
                    request.app.state.engine_client,
                    body["size"],
                    body.get("mode", "drain"),
                    body.get("timeout_s", 60.0),
                )
            )
        except KVCacheResizeFailed as exc:
            return _error(500, str(exc), "InternalServerError")
        except KVCacheResizeError as exc:
            return _error(400, str(exc), "BadRequestError")

    # This module uses postponed annotations; FastAPI needs the class itself
    # to pass the request in.
    for handler, method in ((get_kv_cache_max_memory, "GET"), (set_kv_cache_max_memory_route, "POST")):
        handler.__annotations__["request"] = Request
        router.add_api_route(ROUTE, handler, methods=[method])
    return router
