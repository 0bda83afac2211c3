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
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.kv_cache import kv_cache_tensors, rss_bytes, worker_kv_cache_bytes

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


MADV_DONTNEED = 4  # Linux


def patch(module: Any) -> None:
    """Why: the engine core decides, the workers hold the memory; vLLM's
    ``collective_rpc(name)`` calls a worker method by name. How: adds
    ``WorkerBase.kv_cache_limit_pages``."""

    def apply() -> None:
        module.WorkerBase.kv_cache_limit_pages = kv_cache_limit_pages
        module.WorkerBase.kv_cache_limit_allocated = worker_kv_cache_bytes
        module.WorkerBase.kv_cache_limit_chunk_blocks = kv_cache_limit_chunk_blocks

    optional(WORKER_BASE, apply)


def kv_cache_limit_chunk_blocks(self: Any) -> int:
    """Blocks this worker returns or commits together: a chunk of its
    extensible KV cache, else 1."""
    kv_cache = getattr(getattr(self, "model_runner", None), "extensible_kv_cache", None)
    plan = None if kv_cache is None else extensible_kv_cache.plan_of(kv_cache)
    return 1 if plan is None else plan.blocks_per_chunk


def kv_cache_limit_pages(self: Any, keep: int, num_blocks: int, release: bool) -> int:
    """Release (``release=True``) the pages of blocks ``[keep, num_blocks)``
    of this worker's KV cache with ``madvise(MADV_DONTNEED)``; they read as
    zeros and come back on the next write. Returns the bytes now released
    from ``keep`` on (0 where the layout or device does not allow it: CUDA
    memory is limited logically, not returned). vLLM 0.34's extensible KV
    cache returns and commits again whole chunks of GPU memory instead
    (``hooks.runtime.extensible_kv_cache``)."""
    kv_cache = getattr(getattr(self, "model_runner", None), "extensible_kv_cache", None)
    if kv_cache is not None:
        moved = extensible_kv_cache.pages(kv_cache, keep, num_blocks, release)
        if release:
            logger.info(
                "KV cache chunks of blocks %d-%d released: %d bytes of GPU memory.", keep, num_blocks - 1, moved
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
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        rss = rss_bytes()
        for start, end in ranges:
            if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
                raise OSError(
                    ctypes.get_errno(), f"madvise over the KV cache failed: {os.strerror(ctypes.get_errno())}"
                )
        self._kvcl_rss_fall = rss - rss_bytes()
        logger.info(
            "KV cache pages of blocks %d-%d released: RSS fell by %d bytes.", keep, num_blocks - 1, self._kvcl_rss_fall
        )
    return sum(end - start for start, end in ranges)


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
