"""What a worker's KV cache is made of: its tensors, the storages behind
them and their bytes, and the bytes of a ``KVCacheConfig``'s backing
allocation and of one block in it.

No vLLM import here, and torch only inside the functions that read
tensors, so importing this module costs nothing.
"""

from __future__ import annotations

import mmap
from typing import Any

__all__ = [
    "MADV_DONTNEED",
    "MADV_FREE",
    "backing_bytes",
    "bytes_per_block",
    "held_bytes",
    "kv_cache_storages",
    "kv_cache_tensors",
    "lazy_free_bytes_in",
    "release_advice",
    "self_held_bytes",
    "smaps_field_kib",
    "worker_kv_cache_bytes",
]


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


MADV_DONTNEED = 4
"""Linux: the pages go back to the OS at once (RSS falls; read again as zeros)."""
MADV_FREE = 8
"""Linux 4.5+: the pages go back lazily. They stay mapped and counted in RSS,
as ``LazyFree`` in ``/proc/<pid>/smaps``, until the kernel needs memory: it
then takes them without writing them anywhere (no swap needed). A write
before that keeps the page, with no page fault."""


def release_advice(lazy: bool) -> int:
    """The ``madvise`` advice that returns KV cache pages: ``MADV_FREE``
    for a lazy release, else ``MADV_DONTNEED``."""
    return MADV_FREE if lazy else MADV_DONTNEED


def smaps_field_kib(text: str, field: str) -> int:
    """The sum of one ``smaps``/``smaps_rollup`` field (``Rss``,
    ``LazyFree``, ...) in KiB, over every mapping listed in ``text``."""
    total = 0
    key = field + ":"
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == key:
            total += int(parts[1])
    return total


def held_bytes(smaps_rollup: str) -> int:
    """Resident bytes less those released lazily (``Rss - LazyFree`` of
    ``/proc/<pid>/smaps_rollup``): the memory a process holds that the
    kernel cannot take back without writing it out."""
    return max(0, smaps_field_kib(smaps_rollup, "Rss") - smaps_field_kib(smaps_rollup, "LazyFree")) * 1024


def self_held_bytes() -> int:
    """:func:`held_bytes` of this process."""
    with open("/proc/self/smaps_rollup") as rollup:
        return held_bytes(rollup.read())


def lazy_free_bytes_in(smaps: str, start: int, end: int) -> int:
    """Bytes released lazily (``LazyFree``) in the mappings of ``smaps``
    (the text of ``/proc/<pid>/smaps``) that overlap ``[start, end)``: a
    mapping that also holds other memory counts whole, an upper bound where
    only the KV cache is released lazily."""
    total = 0
    overlaps = False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            low, _, high = head.partition("-")
            try:
                overlaps = int(low, 16) < end and start < int(high, 16)
            except ValueError:
                overlaps = False
        elif overlaps and head == "LazyFree:":
            total += int(line.split()[1]) * 1024
    return total
