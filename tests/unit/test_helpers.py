"""The residency readings and fault-in of ``tests.helpers`` on real memory
laid out like a worker's KV cache: pages given back with madvise read as not
resident, and fault-in brings them back without changing any byte."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import helpers

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and madvise as on Linux")


def page_aligned(pages: int) -> torch.Tensor:
    """Private anonymous memory (page-aligned, as malloc gives large buffers),
    every page written, as a uint8 tensor of one row per page."""
    memory = mmap.mmap(-1, pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(memory, dtype=torch.uint8).reshape(pages, PAGE)
    tensor.copy_(torch.arange(pages * PAGE, dtype=torch.int64).remainder(251).add(1).reshape(pages, PAGE))
    return tensor


def worker_with(*tensors: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches={f"layer{i}": t for i, t in enumerate(tensors)}))


def release(tensor: torch.Tensor, first_page: int, pages: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.madvise(tensor.data_ptr() + first_page * PAGE, pages * PAGE, MADV_DONTNEED) == 0


def test_released_pages_read_as_not_resident_and_fault_in_brings_them_back_unchanged() -> None:
    cache = page_aligned(64)
    worker = worker_with(cache[0:32], cache[32:64])  # two layers viewing one buffer
    assert helpers.kv_cache_resident_bytes(worker) == 64 * PAGE
    expected = cache.clone()
    expected[8:24] = 0  # released pages read as zeros

    release(cache, 8, 16)
    assert helpers.kv_cache_resident_bytes(worker) == 48 * PAGE
    assert helpers.kv_cache_fault_in(worker) == 16 * PAGE
    assert helpers.kv_cache_resident_bytes(worker) == 64 * PAGE
    assert torch.equal(cache, expected)  # fault-in changed no byte
    assert helpers.kv_cache_fault_in(worker) == 0  # nothing left to bring in


def test_fault_in_keeps_the_content_of_pages_that_are_not_resident(tmp_path: Path) -> None:
    """Pages not resident that are not zeros (here a file's, dropped from the
    page cache; for a worker, pages swapped out): fault-in must read each
    byte it writes. The storage starts 100 bytes into its first page."""
    data = bytes((i * 7 + 3) % 251 + 1 for i in range(8 * PAGE))
    path = tmp_path / "pages"
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        memory = mmap.mmap(fd, 8 * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    cache = torch.frombuffer(memory, dtype=torch.uint8, offset=100)
    worker = worker_with(cache)
    assert helpers.kv_cache_resident_bytes(worker) == 0  # the premise: no page in RAM

    assert helpers.kv_cache_fault_in(worker) == 8 * PAGE
    assert helpers.kv_cache_resident_bytes(worker) == 8 * PAGE - 100
    assert bytes(cache.numpy()) == data[100:]


def test_no_reading_for_a_cache_not_on_the_cpu() -> None:
    worker = worker_with(torch.zeros(4, device="meta"))
    assert helpers.kv_cache_resident_bytes(worker) is None
    assert helpers.kv_cache_fault_in(worker) is None
