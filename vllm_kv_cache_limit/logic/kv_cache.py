"""What a worker's KV cache is made of: its tensors, the storages behind
them and their bytes, and the bytes of a ``KVCacheConfig``'s backing
allocation and of one block in it.

No vLLM import here, and torch only inside the functions that read
tensors, so importing this module costs nothing.
"""

from __future__ import annotations

import mmap
from typing import Any

__all__ = ["backing_bytes", "bytes_per_block", "kv_cache_storages", "kv_cache_tensors", "worker_kv_cache_bytes"]


def kv_cache_tensors(worker: Any) -> list[Any]:
    """Every tensor in a worker's ``model_runner.kv_caches`` (a list, tuple
    or dict of them, nested)."""
    import torch

    found: list[Any] = []

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            for sub in item:
                walk(sub)
        elif isinstance(item, dict):
            for sub in item.values():
                walk(sub)

    walk(worker.model_runner.kv_caches)
    return found


def kv_cache_storages(worker: Any) -> dict[int, tuple[int, str]]:
    """The distinct storages behind a worker's KV cache tensors (views of one
    buffer count once): ``{data_ptr: (bytes, device)}``."""
    storages = (tensor.untyped_storage() for tensor in kv_cache_tensors(worker))
    return {s.data_ptr(): (s.nbytes(), str(s.device)) for s in storages}


def worker_kv_cache_bytes(worker: Any) -> int:
    """Bytes of KV cache a worker holds (for ``LLM.collective_rpc``)."""
    return sum(nbytes for nbytes, _ in kv_cache_storages(worker).values())


def backing_bytes(kv_cache_config: Any) -> int:
    """Bytes of the allocation behind a worker's ``KVCacheConfig`` (0 when it
    names none). From vLLM 0.29 every ``KVCacheTensor`` of a worker names the
    same backing allocation, so this is the largest ``size``, not their sum."""
    return max((int(t.size) for t in kv_cache_config.kv_cache_tensors), default=0)


def bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes of that allocation per block: :func:`backing_bytes` over
    ``num_blocks`` (at least 1), rounded up."""
    return -(-backing_bytes(kv_cache_config) // max(1, kv_cache_config.num_blocks))


def rss_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``, as psutil and
    vLLM's CPU gate read it): the worker's measure around its ``madvise``
    calls and the CPU gate's ceiling."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE
