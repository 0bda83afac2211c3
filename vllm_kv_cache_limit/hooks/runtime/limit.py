"""The run-time limit of one engine core: :class:`RuntimeLimit` owns the
limit on its block pool and every change to it (shrink, grow, give back,
settle, release of the pages above it); :class:`EngineCoreState` is all the
run-time limit keeps on an engine core, in one attribute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.errors import KVCacheResizeError
from vllm_kv_cache_limit.logic.limit_math import Allocation
from vllm_kv_cache_limit.logic.sizes import format_size

if TYPE_CHECKING:
    from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
    from vllm_kv_cache_limit.logic.instance_entries import Announcement

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

RELEASE_RETRY_S = 1.0
"""Seconds before a release the workers failed is tried again."""

Pages = Callable[[int, int, bool, bool], int]
"""The workers' pages of blocks ``keep..num_blocks-1``: returned to the OS
(``release``; lazily with ``MADV_FREE`` when the last argument says so, else
at once) or taken back; the bytes it concerned, over all workers."""


@dataclasses.dataclass
class RuntimeLimit:
    """The limit in force on one block pool (which points back to it as
    ``_kvcl_limit``, for the pool's wrappers): blocks at or above ``limit``
    are withheld from the free queue as they become free."""

    pool: Any
    allocation: Allocation
    pages: Pages
    limit: int
    requested: int
    mode: str = "drain"
    withheld: set[int] = dataclasses.field(default_factory=set)
    released_from: int | None = None
    released_bytes: int = 0
    changed_at: float | None = None
    """Wall-clock time of the last change of the limit (None: never changed)."""
    lazy: bool = False
    """The pages above the limit go back lazily (``MADV_FREE``) once it
    holds; set by the last change (a shrink after idling)."""
    released_lazily: bool = False
    """The pages returned at this limit went back lazily."""
    release_failed_at: float | None = None
    """Monotonic time of the last release the workers failed (None: the
    last one worked); it is tried again ``RELEASE_RETRY_S`` later."""

    @property
    def committed(self) -> int:
        """Blocks whose memory the workers may still hold: all of them until
        a release at a limit worked, then those below it. A release that
        failed, wholly or in part, leaves it where it was: an upper bound,
        which the shared budget's ledger holds at least (``autoscaler``)."""
        return self.allocation.num_blocks if self.released_from is None else self.released_from

    @classmethod
    def of(cls, pool: Any) -> RuntimeLimit | None:
        """The limit on ``pool``, if one was ever set."""
        return getattr(pool, "_kvcl_limit", None)

    @classmethod
    def whole(cls, pool: Any, allocation: Allocation, pages: Pages) -> RuntimeLimit:
        """A limit at the whole allocation (what holds before any is set)."""
        return cls(pool, allocation, pages, limit=allocation.num_blocks, requested=allocation.nbytes)

    @classmethod
    def attach(cls, pool: Any, allocation: Allocation, pages: Pages) -> RuntimeLimit:
        """A limit at the whole allocation, set on ``pool``."""
        limit = pool._kvcl_limit = cls.whole(pool, allocation, pages)
        return limit

    def withhold(self, blocks: list[Any]) -> None:
        """Take free blocks at or above the limit out of the free queue (and
        the prefix cache), so the scheduler never hands them out."""
        pool = self.pool
        for block in blocks:
            if block.block_id < self.limit or block.ref_cnt != 0 or block.is_null:
                continue
            if block.prev_free_block is None:  # not in the free queue
                continue
            if pool.enable_caching:
                pool._maybe_evict_cached_block(block)
            pool.free_block_queue.remove(block)
            self.withheld.add(block.block_id)

    def change(self, new: int, nbytes: int, mode: str, scheduler: Any, lazy: bool = False) -> int:
        """Move the limit to ``new`` blocks; returns the old one. A failure
        inside vLLM (preempting, the workers' reply) restores the old limit
        and queue before it propagates: nothing half applied. Requests
        preempted before the failure are recomputed, as any preempted one.
        ``lazy``: the pages above ``new`` go back lazily once it holds."""
        old, old_requested, old_mode, old_lazy = self.limit, self.requested, self.mode, self.lazy
        self.limit, self.requested, self.mode, self.lazy = new, nbytes, mode, lazy
        try:
            if new < old:
                self.shrink(scheduler)
            elif new > old:
                self.grow()
        except BaseException:
            self.limit, self.requested, self.mode, self.lazy = old, old_requested, old_mode, old_lazy
            self.settle()
            raise
        if new != old:
            self.changed_at = time.time()
        return old

    def shrink(self, scheduler: Any) -> None:
        """Withhold the free blocks above the limit; in ``preempt`` mode also
        preempt the requests holding any."""
        pool = self.pool
        above = pool.blocks[self.limit :]
        if pool.enable_caching:
            # Prefix-cache entries in blocks above the limit go now, in use or not,
            # so no new request can hit (and hold) them.
            for block in above:
                if not block.is_null:
                    pool._maybe_evict_cached_block(block)
        self.withhold(above)
        if self.mode == "preempt":
            preempt_above(scheduler, self.limit)

    def preempt(self, scheduler: Any) -> None:
        """Preempt the running requests that still hold blocks above the
        limit (a drain that must not wait for them to finish)."""
        preempt_above(scheduler, self.limit)

    def grow(self) -> None:
        """Queue the withheld blocks below the limit again, and take back
        the pages of the blocks returned to the OS below it."""
        self.give_back()
        if self.released_from is not None and self.released_from < self.limit:
            num_blocks = self.allocation.num_blocks
            try:
                self.released_bytes = self.pages(self.limit, num_blocks, False, False)
            except BaseException:
                # Workers that committed up to the new limit give it back: on
                # a GPU nothing stays mapped above the limit that holds.
                try:
                    self.pages(self.released_from, num_blocks, True, False)
                except Exception:
                    # What stays mapped is not known: all of it counts as
                    # committed until a release at the limit works.
                    self.released_from = None
                    logger.exception("Returning the chunks mapped by a failed raise of the KV cache limit failed.")
                raise
            self.released_from = self.limit if self.released_bytes else None

    def give_back(self) -> None:
        """Queue the withheld blocks below the limit again."""
        back = sorted(i for i in self.withheld if i < self.limit)
        self.pool.free_block_queue.append_n([self.pool.blocks[i] for i in back])
        self.withheld.difference_update(back)

    @contextlib.contextmanager
    def withheld_queued(self) -> Iterator[None]:
        """The withheld blocks back in the free queue while the body runs
        (vLLM code that must see every unused block free and allocates none:
        ``reset_prefix_cache``), withheld again after it, even if it raised."""
        self.pool.free_block_queue.append_n([self.pool.blocks[i] for i in sorted(self.withheld)])
        self.withheld.clear()
        try:
            yield
        finally:
            self.settle()

    def settle(self) -> None:
        """Make the free queue match the limit again (after a failed change):
        withheld blocks below it queued, free blocks at or above it withheld.
        Touches only free blocks, so it cannot fail on a request."""
        self.give_back()
        self.withhold(self.pool.blocks[self.limit :])

    def release_due(self, now: float | None = None) -> bool:
        """Whether every block above the limit is withheld (none is in use)
        while their pages have not been returned at this limit yet (and a
        failed release's retry is due)."""
        above = self.allocation.num_blocks - self.limit
        if above <= 0 or self.released_from == self.limit or len(self.withheld) != above:
            return False
        failed = self.release_failed_at
        return failed is None or (time.monotonic() if now is None else now) - failed >= RELEASE_RETRY_S

    def release_if_due(self, now: float | None = None) -> None:
        """Return the pages of the blocks above the limit to the OS (through
        the workers) once none of them is in use. A failure is logged (once
        until a release works), never raised into vLLM's step; the pages
        then count as allocated (``committed``) and the release is tried
        again ``RELEASE_RETRY_S`` later."""
        if not self.release_due(now):  # every step: no clock read unless a release failed
            return
        num_blocks = self.allocation.num_blocks
        try:
            released = self.pages(self.limit, num_blocks, True, self.lazy)
        except Exception:
            now = time.monotonic() if now is None else now
            if self.release_failed_at is None:
                logger.exception(
                    "Returning the KV cache pages of blocks %d-%d to the OS failed; they count as allocated and "
                    "it is tried again every %g s (logged once until it works).",
                    self.limit,
                    num_blocks - 1,
                    RELEASE_RETRY_S,
                )
            self.release_failed_at = now
            return
        if self.release_failed_at is not None:
            logger.info(
                "Returning the KV cache pages of blocks %d-%d to the OS works again.", self.limit, num_blocks - 1
            )
        self.release_failed_at = None
        self.released_bytes, self.released_lazily = released, self.lazy
        self.released_from = self.limit
        logger.info(
            "KV cache limit holds: the pages of blocks %d-%d returned to the OS%s, a range of %s (each worker's "
            "line says how much of it was resident: only pages ever written are memory).",
            self.limit,
            num_blocks - 1,
            " lazily (MADV_FREE: taken when the OS needs memory)" if self.released_lazily else "",
            format_size(self.released_bytes),
        )

    def usage(self) -> tuple[int, int]:
        """Blocks in use, and of those, blocks at or above the limit."""
        free = self.pool.get_num_free_blocks()
        in_use = self.allocation.num_blocks - limit_math.NULL_BLOCKS - free - len(self.withheld)
        above = sum(1 for block in self.pool.blocks[self.limit :] if block.ref_cnt > 0 and not block.is_null)
        return in_use, above


def preempt_above(scheduler: Any, limit: int) -> None:
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


@dataclasses.dataclass
class EngineCoreState:
    """All the run-time limit keeps on one engine core (as ``_kvcl_state``)."""

    allocation: Allocation | None = None
    """The start-up allocation, read once (it asks the workers)."""
    autoscaler: Autoscaler | None = None
    """With ``--kv-cache-autoscale``, once started."""
    in_step: bool = False
    """A step (or an abort) of the engine core is in progress."""
    lock: threading.RLock | None = None
    """An in-process engine core's autoscaling lock: held by every call the
    client makes into it (``hooks.runtime.client``) and by a decision its
    timer takes (``autoscaler.start_deciding``)."""
    announcement: Announcement | None = None
    """With a cap: this engine core's entry in the lock folder (``hooks.engine_entry``)."""

    @classmethod
    def of(cls, engine_core: Any) -> EngineCoreState:
        """The engine core's state, created empty on first use."""
        state: EngineCoreState | None = getattr(engine_core, "_kvcl_state", None)
        if state is None:
            state = engine_core._kvcl_state = cls()
        return state

    @classmethod
    def peek(cls, engine_core: Any) -> EngineCoreState | None:
        """The engine core's state if it has one, without creating it."""
        return getattr(engine_core, "_kvcl_state", None)


def allocation_of(engine_core: Any) -> Allocation:
    """The start-up allocation, read once per engine (it asks the workers)."""
    state = EngineCoreState.of(engine_core)
    if state.allocation is None:
        state.allocation = _read_allocation(engine_core)
    return state.allocation


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
    chunk = 1
    if getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False):
        chunk = max(int(b) for b in engine_core.model_executor.collective_rpc("kv_cache_limit_chunk_blocks"))
    return Allocation(
        blocks_per_chunk=chunk,
        num_blocks=num_blocks,
        bytes_per_block=min(allocated) // num_blocks,
        blocks_per_request=per_request,
        max_model_len=vllm_config.model_config.max_model_len,
        largest_bytes_per_block=-(-max(allocated) // num_blocks),
    )


def pages_of(engine_core: Any) -> Pages:
    """The workers' pages of an engine core, through ``worker_pages`` as it
    is when called."""
    return lambda keep, num_blocks, release, lazy: worker_pages(engine_core, keep, num_blocks, release, lazy)


def worker_pages(engine_core: Any, keep: int, num_blocks: int, release: bool, lazy: bool = False) -> int:
    results = engine_core.model_executor.collective_rpc("kv_cache_limit_pages", args=(keep, num_blocks, release, lazy))
    return sum(int(r) for r in results)


FREE_BLOCK_QUEUE_APPEND_N = Hook(("vllm.v1.core.kv_cache_utils",), "FreeKVCacheBlockQueue.append_n", ("self",))

SCHEDULER_PREEMPT_REQUEST = Hook(
    ("vllm.v1.core.sched.scheduler",), "Scheduler._preempt_request", ("self", "request", "timestamp")
)

# Called, not wrapped: the blocks a request holds (``preempt_above``).
KV_CACHE_MANAGER_GET_BLOCKS = Hook(
    ("vllm.v1.core.kv_cache_manager",), "KVCacheManager.get_blocks", ("self", "request_id")
)

KV_CACHE_BLOCKS_GET_BLOCK_IDS = Hook(("vllm.v1.core.kv_cache_manager",), "KVCacheBlocks.get_block_ids", ("self",))

# Called, not wrapped: the workers' pages, chunk size and allocation (the engine
# core's executor; every release and grow, and an autoscaled start-up).
EXECUTOR_COLLECTIVE_RPC = Hook(
    ("vllm.v1.executor.abstract",), "Executor.collective_rpc", ("self", "method", "timeout", "args", "kwargs")
)

HOOKS = (
    FREE_BLOCK_QUEUE_APPEND_N,
    EXECUTOR_COLLECTIVE_RPC,
    SCHEDULER_PREEMPT_REQUEST,
    KV_CACHE_MANAGER_GET_BLOCKS,
    KV_CACHE_BLOCKS_GET_BLOCK_IDS,
)

TARGETS: dict[str, Callable[[Any], None]] = {}
"""Patches no vLLM module: it is called from the hooks of ``engine_core`` and ``block_pool``."""
