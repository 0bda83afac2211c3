"""``vllm_kv_cache_limit.logic.kv_cache``: a worker's KV cache tensors, the storages
behind them (views of one buffer count once) and their bytes; the backing
bytes and the bytes per block of a ``KVCacheConfig``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_kv_cache_limit.logic.kv_cache import (
    MADV_FREE,
    backing_bytes,
    bytes_per_block,
    held_bytes,
    kv_cache_storages,
    kv_cache_tensors,
    lazy_free_bytes_in,
    smaps_field_kib,
    worker_kv_cache_bytes,
)


def worker_with(kv_caches: object) -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches=kv_caches))


def config(sizes: list[int], num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=s) for s in sizes], num_blocks=num_blocks)


def test_kv_cache_tensors_walks_nested_lists_tuples_and_dicts() -> None:
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    worker = worker_with({"layer0": [a, (b, "not a tensor")], "layer1": {"k": c, "v": [d]}, "none": None})
    assert [t.numel() for t in kv_cache_tensors(worker)] == [1, 2, 3, 4]
    assert kv_cache_tensors(worker_with([])) == []


def test_storages_count_views_of_one_buffer_once() -> None:
    buffer = torch.zeros(1024, dtype=torch.uint8)
    other = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    worker = worker_with([buffer[:512], buffer[512:], other])
    storages = kv_cache_storages(worker)
    assert storages == {
        buffer.untyped_storage().data_ptr(): (1024, "cpu"),
        other.untyped_storage().data_ptr(): (256, "cpu"),
    }
    # The whole storage counts, not the views' elements: 1024 + 256.
    assert worker_kv_cache_bytes(worker) == 1280
    assert worker_kv_cache_bytes(worker_with(buffer[:10])) == 1024
    assert worker_kv_cache_bytes(worker_with({})) == 0


def test_backing_bytes_is_the_one_shared_allocation_not_a_sum() -> None:
    # vLLM 0.29+: every KVCacheTensor of a worker names the same allocation.
    assert backing_bytes(config([4096, 4096, 4096], 8)) == 4096
    assert backing_bytes(config([1024, 4096], 8)) == 4096
    assert backing_bytes(config([], 8)) == 0


@pytest.mark.parametrize(
    ("sizes", "num_blocks", "expected"),
    [
        ([4096, 4096], 4, 1024),  # exact
        ([1000], 3, 334),  # rounded up, never down
        ([1000], 0, 1000),  # no block: at least one
        ([], 5, 0),
    ],
)
def test_bytes_per_block(sizes: list[int], num_blocks: int, expected: int) -> None:
    assert bytes_per_block(config(sizes, num_blocks)) == expected


@given(st.integers(min_value=0, max_value=2**44), st.integers(min_value=1, max_value=2**20))
def test_bytes_per_block_is_the_smallest_that_covers_the_backing(backing: int, num_blocks: int) -> None:
    per_block = bytes_per_block(config([backing], num_blocks))
    assert per_block * num_blocks >= backing > (per_block - 1) * num_blocks


def test_import_loads_neither_torch_nor_vllm() -> None:
    code = "import sys, vllm_kv_cache_limit.logic.kv_cache; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


ROLLUP = """55d0c0a00000-7ffd3b7fe000 ---p 00000000 00:00 0                          [rollup]
Rss:              123456 kB
Pss:              120000 kB
Anonymous:        100000 kB
LazyFree:          40960 kB
AnonHugePages:         0 kB
"""

SMAPS = """7f0000000000-7f0004000000 rw-p 00000000 00:00 0
Size:              65536 kB
Rss:               65536 kB
LazyFree:          40960 kB
VmFlags: rd wr mr mw me ac
7f0004000000-7f0004001000 r--p 00000000 08:01 1234                       /usr/lib/libc.so.6
Size:                  4 kB
Rss:                   4 kB
LazyFree:              4 kB
7f0005000000-7f0005400000 rw-p 00000000 00:00 0
Rss:                1024 kB
LazyFree:            512 kB
"""


def test_held_bytes_is_rss_less_lazy_free() -> None:
    assert smaps_field_kib(ROLLUP, "Rss") == 123456
    assert smaps_field_kib(ROLLUP, "LazyFree") == 40960
    assert held_bytes(ROLLUP) == (123456 - 40960) * 1024
    assert held_bytes("Rss: 10 kB\n") == 10 * 1024  # a kernel without LazyFree
    assert smaps_field_kib(SMAPS, "Rss") == 65536 + 4 + 1024


def test_lazy_free_bytes_in_counts_the_mappings_that_overlap() -> None:
    base = 0x7F0000000000
    # Inside the first mapping only.
    assert lazy_free_bytes_in(SMAPS, base + 4096, base + 8192) == 40960 * 1024
    # Across the first two: both count; the third (not reached) does not.
    assert lazy_free_bytes_in(SMAPS, base, 0x7F0004000800) == (40960 + 4) * 1024
    # The end is exclusive, and a range in no mapping counts nothing.
    assert lazy_free_bytes_in(SMAPS, 0x7F0004001000, 0x7F0005000000) == 0
    assert lazy_free_bytes_in(SMAPS, 0x7F0005000000, 0x7F0005000001) == 512 * 1024


def test_a_lazy_release_shows_in_this_process_held_bytes() -> None:
    import ctypes
    import mmap
    import os

    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("no /proc/self/smaps_rollup")
    from vllm_kv_cache_limit.logic.kv_cache import self_held_bytes

    size = 64 * 2**20
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.write(b"x" * size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        before = self_held_bytes()
        if libc.madvise(address, size, MADV_FREE) != 0:
            pytest.skip("no MADV_FREE on this kernel")
        with open("/proc/self/smaps") as smaps:
            lazy = lazy_free_bytes_in(smaps.read(), address, address + size)
        assert lazy >= 0.9 * size, lazy
        assert before - self_held_bytes() >= 0.9 * size
        # Written again, the pages are held again, with their new content.
        region.seek(0)
        region.write(b"y" * size)
        with open("/proc/self/smaps") as smaps:
            assert lazy_free_bytes_in(smaps.read(), address, address + size) == 0
        assert region[:1] == b"y" and region[size - 1 :] == b"y"
    finally:
        del address
        region.close()


def test_lazily_released_pages_count_as_available_to_vllms_cpu_check() -> None:
    """What a co-located instance's start-up sees after an idle one released
    lazily (docs/autoscale.md): vLLM's CPU backend counts a memory node's
    free and file pages as available, and pages given back with
    ``MADV_FREE`` move to the inactive file list while they stay in this
    process (``LazyFree``). The node's figures trail the pages by up to a
    second (the kernel folds its per-CPU counts), and other processes move
    them too: each reading is waited for, with a bound. Memory is read as
    used (total less available): these machines add memory to the node as
    it is used, which raises both."""
    import ctypes
    import mmap
    import os
    import time

    from vllm.utils.cpu_resource_utils import get_cgroup_memory_limit, get_memory_node_info

    if not os.path.exists("/sys/devices/system/node/node0/meminfo"):
        pytest.skip("no per-node meminfo: vLLM reads psutil's figures instead")
    node = get_memory_node_info(0)
    limit = get_cgroup_memory_limit()
    if limit is not None and limit < node.total_memory:
        pytest.skip("a cgroup memory limit: vLLM reads its usage, which counts lazily freed pages (documented)")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    size = 256 * 2**20

    def used() -> int:
        node = get_memory_node_info(0)
        return node.total_memory - node.available_memory

    def waited(condition) -> bool:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return False

    seen = []
    for _ in range(3):  # another process's allocation in the window moves the node's figures: try again
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        try:
            before = used()
            region.write(b"x" * size)
            # The premise: the written pages show as taken.
            taken = waited(lambda before=before: used() - before >= 0.9 * size)
            written = used()
            if libc.madvise(address, size, MADV_FREE) != 0:
                pytest.skip("no MADV_FREE on this kernel")
            back = waited(lambda written=written: written - used() >= 0.9 * size)
            with open("/proc/self/smaps") as smaps:  # still this process's pages, lazily freed
                lazy = lazy_free_bytes_in(smaps.read(), address, address + size)
            seen.append({"taken": written - before, "given back": written - used(), "LazyFree": lazy})
        finally:
            del address
            region.close()
        if taken and back and lazy >= 0.9 * size:
            return
    pytest.fail(f"per try, bytes of {size} written then lazily freed: {seen}")
