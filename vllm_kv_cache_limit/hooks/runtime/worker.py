"""vllm.v1.worker.worker_base: the workers give the pages of withheld blocks
back to the OS.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.runtime import extensible_kv_cache
from vllm_kv_cache_limit.hooks.runtime.availability import RESIZE_REMOVE, RESIZE_UPSTREAM, optional
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.budget_ledger import Companions
from vllm_kv_cache_limit.logic.kv_cache import (
    MADV_DONTNEED,
    MADV_FREE,
    kv_cache_tensors,
    release_advice,
    rss_bytes,
    self_held_bytes,
    worker_kv_cache_bytes,
)

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def patch(module: Any) -> None:
    """Why: the engine core decides, the workers hold the memory; vLLM's
    ``collective_rpc(name)`` calls a worker method by name. How: adds
    ``WorkerBase.kv_cache_limit_pages`` (and the methods the engine core
    calls beside it: the allocation, the chunk, the committable blocks, the
    companions of its ledger entries)."""

    def apply() -> None:
        module.WorkerBase.kv_cache_limit_pages = kv_cache_limit_pages
        module.WorkerBase.kv_cache_limit_allocated = worker_kv_cache_bytes
        module.WorkerBase.kv_cache_limit_chunk_blocks = kv_cache_limit_chunk_blocks
        module.WorkerBase.kv_cache_limit_committable = kv_cache_limit_committable
        module.WorkerBase.kv_cache_limit_hold_entries = kv_cache_limit_hold_entries

    optional(WORKER_BASE, apply)


def _extensible_cache(worker: Any) -> Any:
    """The worker's vLLM 0.34 extensible KV cache, if it has one."""
    return getattr(getattr(worker, "model_runner", None), "extensible_kv_cache", None)


def kv_cache_limit_chunk_blocks(self: Any) -> int:
    """Blocks this worker returns or commits together: a chunk of its
    extensible KV cache, else 1."""
    kv_cache = _extensible_cache(self)
    plan = None if kv_cache is None else extensible_kv_cache.plan_of(kv_cache)
    return 1 if plan is None else plan.blocks_per_chunk


def kv_cache_limit_committable(self: Any) -> int:
    """The most blocks a raised limit may commit on this worker without
    taking the memory vLLM keeps for activations (-1: no bound, nothing is
    committed: no extensible KV cache, or one not mapped in chunks)."""
    kv_cache = _extensible_cache(self)
    return -1 if kv_cache is None else extensible_kv_cache.committable(kv_cache)


def kv_cache_limit_hold_entries(self: Any, entries: list[tuple[str, str, str]]) -> int:
    """Hold a companion of each of the instance's ledger entries (lock
    folder, device key, entry name) for as long as this worker lives
    (``budget_ledger.Companions``): an engine core killed before its
    workers then leaves their memory counted until they exit. How many this
    worker holds; one it cannot create is logged, and does not stop it."""
    state = WorkerState.of(self)
    if state.companions is None:
        state.companions = Companions()
    rank = int(getattr(self, "rank", 0) or 0)
    for folder, key, entry in entries:
        try:
            state.companions.hold(str(folder), str(key), str(entry), rank)
        except OSError as exc:  # a link planted in its place, a folder refused
            logger.warning(
                "KV cache autoscale: this worker could not hold a companion of its ledger entry %s (%s); if the "
                "engine core dies before this worker, the entry may go before this worker's memory does.",
                entry,
                exc,
            )
    return len(state.companions.held)


def kv_cache_limit_pages(self: Any, keep: int, num_blocks: int, release: bool, lazy: bool = False) -> int:
    """Release (``release=True``) the pages of blocks ``[keep, num_blocks)``
    of this worker's KV cache with ``madvise(MADV_DONTNEED)``: they read as
    zeros and come back on the next write. ``lazy``: with
    ``madvise(MADV_FREE)`` instead: they stay mapped until the kernel needs
    memory and takes them (no page fault when written before that); where
    the kernel refuses it, at once. Returns the bytes now released from
    ``keep`` on (0 where the layout or device does not allow it: CUDA memory
    is limited logically, not returned). vLLM 0.34's extensible KV cache
    returns and commits again whole chunks of GPU memory instead, at once
    (``hooks.runtime.extensible_kv_cache``)."""
    kv_cache = _extensible_cache(self)
    if kv_cache is not None:
        moved = extensible_kv_cache.pages(kv_cache, keep, num_blocks, release)
        if release and extensible_kv_cache.plan_of(kv_cache) is not None:
            cleared = extensible_kv_cache.clear_stale_block_ids(self.model_runner, kv_cache, keep)
            logger.info(
                "KV cache chunks of blocks %d-%d released: %d bytes of GPU memory; %d stale block-table "
                "entries at or above block %d now name the null block.",
                keep,
                num_blocks - 1,
                moved,
                cleared,
                keep,
            )
        return moved
    spans = []
    for view in kv_cache_tensors(self):
        if view.device.type != "cpu" or view.dim() < 2 or view.shape[0] != num_blocks:
            return 0
        stride = view.stride(0) * view.element_size()
        block_bytes = view[0].numel() * view.element_size()
        spans += limit_math.block_spans(view.data_ptr(), stride, block_bytes, keep, num_blocks)
    ranges = limit_math.page_ranges(spans, mmap.PAGESIZE)
    if release:
        advice = release_advice(lazy)
        resident = _resident_bytes(ranges)
        held = self_held_bytes() if lazy else rss_bytes()
        if advice == MADV_FREE and not _madvise_all(ranges, MADV_FREE, refused_ok=True):
            advice = MADV_DONTNEED  # no MADV_FREE here (before Linux 4.5, or not private anonymous memory)
        if advice == MADV_DONTNEED:
            _madvise_all(ranges, MADV_DONTNEED)
        state = WorkerState.of(self)  # the state its cap hooks attached, under a cap
        # Lazily freed pages stay in RSS, as LazyFree, until the kernel takes them.
        state.rss_fall = held - (self_held_bytes() if lazy else rss_bytes())
        # The range is address space; only its pages ever written are memory.
        logger.info(
            "KV cache pages of blocks %d-%d released%s: %s fell by %d bytes (a range of %d bytes, %d of them resident).",
            keep,
            num_blocks - 1,
            " lazily" if advice == MADV_FREE else "",
            "RSS less LazyFree" if lazy else "RSS",
            state.rss_fall,
            sum(end - start for start, end in ranges),
            resident,
        )
    return sum(end - start for start, end in ranges)


_RESIDENT_BIT = bytes(value & 1 for value in range(256))
"""``mincore`` sets bit 0 of a page's byte when it is resident; the other bits are reserved."""


def _resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of the page ranges that are in memory (``mincore``): a KV cache
    page is memory only once written. -1 where the kernel will not say."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    pages = 0
    for start, end in ranges:
        vec = (ctypes.c_ubyte * ((end - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        if libc.mincore(start, end - start, vec) != 0:
            return -1
        pages += bytes(vec).translate(_RESIDENT_BIT).count(1)
    return pages * mmap.PAGESIZE


def _madvise_all(ranges: list[tuple[int, int]], advice: int, refused_ok: bool = False) -> bool:
    """``madvise(advice)`` over each range; False when the kernel refused
    the advice itself (``EINVAL``) and ``refused_ok``, OSError on any other
    failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, end in ranges:
        if libc.madvise(start, end - start, advice) != 0:
            errno = ctypes.get_errno()
            if refused_ok and errno == 22:  # EINVAL
                return False
            raise OSError(errno, f"madvise over the KV cache failed: {os.strerror(errno)}")
    return True


WORKER_BASE = Hook(
    ("vllm.v1.worker.worker_base",),
    "WorkerBase",
    wrapper=patch,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

HOOKS = (WORKER_BASE,)

TARGETS = {"vllm.v1.worker.worker_base": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
