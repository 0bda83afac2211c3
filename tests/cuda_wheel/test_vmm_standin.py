"""vLLM 0.34's extensible KV cache over host memory: the VMM driver stand-in
(``tests/cuda_wheel/vmm_standin.py``) enforces CUDA's rules for the calls
vLLM makes, and vLLM's own ``ExtensibleTensor`` and ``ExtensibleKVCache``
run over it unchanged, so that what they map, keep and give back is
measured in the process's memory: the premise of returning GPU memory above
a run-time limit (issue 42).

RSS is read as ``RssShmem`` (``/proc/self/status``): the stand-in's chunks
are memfd (shared memory) pages, and nothing else in the test process maps
shared memory while it runs, so the reading moves by the chunks alone."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
import torch
from vllm.utils.extensible_tensor import ExtensibleTensor
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache

from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB, VmmRuleError

GRANULE = 2 * MiB
RSS_SLACK = 2 * MiB
"""What other shared-memory pages may move the reading by during a test."""
CHILD_TIMEOUT_S = 20.0


def rss_shmem() -> int:
    """Resident shared-memory bytes of this process (``RssShmem``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def rss_total() -> int:
    """Resident bytes of this process (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_in_child(addr: int) -> int:
    """Read one byte at ``addr`` in a forked child (which sees this
    process's mappings); its exit: 0 when the read worked, else ``-signal``."""
    pid = os.fork()
    if pid == 0:  # child: no Python code after the read but _exit
        try:
            import faulthandler
            import resource

            faulthandler.disable()
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            signal.signal(signal.SIGBUS, signal.SIG_DFL)
            ctypes.string_at(addr, 1)
            os._exit(0)
        finally:
            os._exit(3)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the child reading {addr:#x} did not end within {CHILD_TIMEOUT_S} s")


def drop_chunks_above(tensor: ExtensibleTensor, driver: HostVmmDriver, sizes: list[int]) -> int:
    """Unmap and release, directly through the driver, every chunk of
    ``tensor`` that lies wholly above ``sizes[i]`` in its segment, and make
    vLLM's bookkeeping match (it has no call for this: ``ExtensibleTensor``
    is grow-only). Returns the bytes given back. A chunk straddling a
    segment's new end cannot be given back in part (cuMemUnmap of a
    sub-range), so it fails the test."""
    buffer = tensor._buffer
    granule = buffer.granularity
    ends = [offset + size for offset, size in zip(tensor.segment_offsets, sizes)]
    starts = tensor.segment_offsets
    kept, dropped = [], 0
    for handle, offset, size in buffer._handles:
        segment = max(i for i, start in enumerate(starts) if start <= offset)
        if offset >= ends[segment]:
            driver.unmap(buffer.base_ptr + offset, size)
            driver.release(handle)
            buffer._mapped_granules -= set(range(offset // granule, (offset + size) // granule))
            dropped += size
        elif offset + size > ends[segment]:
            raise AssertionError(f"the chunk at {offset:#x} straddles segment {segment}'s new end {ends[segment]:#x}")
        else:
            kept.append((handle, offset, size))
    buffer._handles = kept
    tensor._committed = list(sizes)
    return dropped


# -- (a) CUDA's rules ------------------------------------------------------


def test_map_only_inside_a_reservation(driver: HostVmmDriver) -> None:
    base = driver.reserve(4 * MiB)
    handle = driver.create(4 * MiB, 0)
    outside = driver.reserve(2 * MiB)
    driver.free_reserved(outside, 2 * MiB)  # an address known to be unreserved now
    with pytest.raises(VmmRuleError, match="maps only inside a reservation"):
        driver.map(outside, 2 * MiB, handle)
    with pytest.raises(VmmRuleError, match="maps only inside a reservation"):
        driver.map(base + 2 * MiB, 4 * MiB, handle)  # runs past the reservation's end
    driver.map(base, 4 * MiB, handle)
    assert driver.mapped_bytes == 4 * MiB


def test_never_map_over_a_mapping(driver: HostVmmDriver) -> None:
    base = driver.reserve(8 * MiB)
    driver.map(base, 4 * MiB, driver.create(4 * MiB, 0))
    other = driver.create(4 * MiB, 0)
    for ptr in (base, base + 2 * MiB):
        with pytest.raises(VmmRuleError, match="never over an existing mapping") as error:
            driver.map(ptr, 4 * MiB, other)
        assert "CUDA_ERROR_INVALID_VALUE" in str(error.value)
    driver.map(base + 4 * MiB, 4 * MiB, other)  # the free half maps
    assert driver.mapped_bytes == 8 * MiB


def test_unmap_only_a_whole_mapping(driver: HostVmmDriver) -> None:
    base = driver.reserve(8 * MiB)
    handle = driver.create(8 * MiB, 0)
    driver.map(base, 8 * MiB, handle)
    for ptr, size in ((base, 2 * MiB), (base + 2 * MiB, 6 * MiB), (base, 4 * MiB)):
        with pytest.raises(VmmRuleError, match="unmaps only a whole mapping, no sub-range"):
            driver.unmap(ptr, size)
    assert driver.mapped_bytes == 8 * MiB
    driver.unmap(base, 8 * MiB)
    assert driver.mapped_bytes == 0
    with pytest.raises(VmmRuleError, match="unmaps only a whole mapping"):
        driver.unmap(base, 8 * MiB)  # twice


def test_release_of_a_mapped_handle_is_deferred_to_its_unmap(driver: HostVmmDriver) -> None:
    """cuMemRelease's documented behaviour: a mapped handle may be released,
    its memory freed when the last mapping goes; strict_release refuses it."""
    base = driver.reserve(4 * MiB)
    handle = driver.create(4 * MiB, 0)
    driver.map(base, 4 * MiB, handle)
    driver.set_access(base, 4 * MiB, 0)
    ctypes.memset(base, 0x5A, 4 * MiB)
    driver.release(handle)
    assert driver.deferred_releases == 1
    assert driver.physical_bytes == 4 * MiB
    assert ctypes.string_at(base + 3 * MiB, 4) == b"\x5a" * 4  # still backed
    with pytest.raises(VmmRuleError, match="not a live handle"):
        driver.release(handle)  # twice
    with pytest.raises(VmmRuleError, match="not a live handle"):
        driver.map(base, 4 * MiB, handle)
    driver.unmap(base, 4 * MiB)
    assert driver.physical_bytes == 0

    strict = HostVmmDriver(GRANULE, strict_release=True)
    try:
        base = strict.reserve(2 * MiB)
        handle = strict.create(2 * MiB, 0)
        strict.map(base, 2 * MiB, handle)
        with pytest.raises(VmmRuleError, match="release a handle only after it is unmapped"):
            strict.release(handle)
        strict.unmap(base, 2 * MiB)
        strict.release(handle)
        assert strict.physical_bytes == 0
    finally:
        strict.close()


def test_free_a_reservation_only_when_nothing_is_mapped_in_it(driver: HostVmmDriver) -> None:
    base = driver.reserve(8 * MiB)
    handle = driver.create(2 * MiB, 0)
    driver.map(base + 6 * MiB, 2 * MiB, handle)
    with pytest.raises(VmmRuleError, match="freed only when nothing is mapped in it"):
        driver.free_reserved(base, 8 * MiB)
    with pytest.raises(VmmRuleError, match="freed whole"):
        driver.free_reserved(base, 4 * MiB)
    driver.unmap(base + 6 * MiB, 2 * MiB)
    driver.release(handle)
    driver.free_reserved(base, 8 * MiB)
    assert driver.reservations == {}


@pytest.mark.parametrize("call", ["reserve", "create", "map_ptr", "map_size", "unmap", "set_access"])
def test_sizes_and_offsets_are_multiples_of_the_granularity(driver: HostVmmDriver, call: str) -> None:
    base = driver.reserve(8 * MiB)
    handle = driver.create(4 * MiB, 0)
    odd = GRANULE // 2
    attempts = {
        "reserve": lambda: driver.reserve(4 * MiB + odd),
        "create": lambda: driver.create(odd, 0),
        "map_ptr": lambda: driver.map(base + odd, 2 * MiB, handle),
        "map_size": lambda: driver.map(base, 2 * MiB + odd, handle),
        "unmap": lambda: driver.unmap(base, odd),
        "set_access": lambda: driver.set_access(base, odd, 0),
    }
    with pytest.raises(VmmRuleError, match=r"must be a multiple of the granularity \(0x200000\)"):
        attempts[call]()
    assert driver.mapped_bytes == 0


def test_set_access_only_over_a_fully_mapped_range(driver: HostVmmDriver) -> None:
    base = driver.reserve(8 * MiB)
    driver.map(base, 2 * MiB, driver.create(2 * MiB, 0))
    driver.map(base + 2 * MiB, 2 * MiB, driver.create(2 * MiB, 0))
    with pytest.raises(VmmRuleError, match="the range must be fully mapped"):
        driver.set_access(base, 6 * MiB, 0)
    with pytest.raises(VmmRuleError, match="within the allocation"):
        driver.map(base + 4 * MiB, 4 * MiB, driver.create(2 * MiB, 0))  # more than the handle
    driver.set_access(base, 4 * MiB, 0)  # two adjacent mappings, one range
    assert read_in_child(base + 4 * MiB - 1) == 0


def test_an_address_without_access_faults(driver: HostVmmDriver) -> None:
    """Touching reserved-but-unmapped, or mapped-but-not-granted, memory
    faults, as on the device; a granted byte reads."""
    base = driver.reserve(6 * MiB)
    driver.map(base, 2 * MiB, driver.create(2 * MiB, 0))
    driver.set_access(base, 2 * MiB, 0)
    driver.map(base + 2 * MiB, 2 * MiB, driver.create(2 * MiB, 0))
    assert read_in_child(base + 2 * MiB - 1) == 0
    assert read_in_child(base + 2 * MiB) in (-signal.SIGSEGV, -signal.SIGBUS)  # mapped, no access
    assert read_in_child(base + 4 * MiB) in (-signal.SIGSEGV, -signal.SIGBUS)  # reserved only


def test_counts_calls_and_bytes(driver: HostVmmDriver) -> None:
    base = driver.reserve(8 * MiB)
    handles = [driver.create(2 * MiB, 0) for _ in range(3)]
    for i, handle in enumerate(handles):
        driver.map(base + i * 2 * MiB, 2 * MiB, handle)
    driver.set_access(base, 6 * MiB, 0)
    driver.unmap(base + 4 * MiB, 2 * MiB)
    driver.release(handles[2])
    assert {k: driver.calls[k] for k in ("reserve", "create", "map", "set_access", "unmap", "release")} == {
        "reserve": 1,
        "create": 3,
        "map": 3,
        "set_access": 1,
        "unmap": 1,
        "release": 1,
    }
    assert (driver.mapped_bytes, driver.physical_bytes) == (4 * MiB, 4 * MiB)
    assert (driver.bytes_mapped_total, driver.bytes_unmapped_total) == (6 * MiB, 2 * MiB)


# -- (b) vLLM's ExtensibleTensor and ExtensibleKVCache over it ----------------


def test_extensible_tensor_commits_and_chunks_above_a_size_return_memory(driver: HostVmmDriver) -> None:
    """Four 32 MiB segments grown to 16 then 32 MiB each: every grow maps
    one chunk per segment and the memory becomes resident; giving back each
    segment's second chunk through the driver returns 64 MiB with the first
    chunks' contents intact; growing again maps fresh zeroed pages."""
    segments, half = 4, 16 * MiB
    tensor = ExtensibleTensor(segments * 2 * half, device="cuda:0", num_segments=segments)
    try:
        assert tensor.granularity == GRANULE and driver.mapped_bytes == 0
        before = rss_shmem()
        tensor.resize_per_segment_(half, zero_new=True)
        assert (driver.calls["create"], driver.calls["map"]) == (segments, segments)
        assert driver.mapped_bytes == tensor.physical_bytes == segments * half
        assert abs(rss_shmem() - before - segments * half) <= RSS_SLACK
        full = tensor.full_view()
        assert full.device.type == "cpu"
        for i, offset in enumerate(tensor.segment_offsets):
            full[offset : offset + half].fill_(i + 1)

        rss_total_grown = rss_total()
        tensor.resize_per_segment_(2 * half, zero_new=True)
        assert (driver.calls["create"], driver.calls["map"]) == (2 * segments, 2 * segments)
        assert driver.mapped_bytes == 2 * segments * half
        assert abs(rss_shmem() - before - 2 * segments * half) <= RSS_SLACK
        assert rss_total() - rss_total_grown >= segments * half - RSS_SLACK

        grown = rss_shmem()
        dropped = drop_chunks_above(tensor, driver, [half] * segments)
        assert dropped == segments * half
        assert driver.mapped_bytes == tensor.physical_bytes == segments * half
        assert driver.physical_bytes == segments * half  # released, not only unmapped
        assert abs(grown - rss_shmem() - segments * half) <= RSS_SLACK
        for i, offset in enumerate(tensor.segment_offsets):
            kept = full[offset : offset + half]
            assert bool((kept == i + 1).all()), f"segment {i}'s first chunk lost its contents"
            assert read_in_child(tensor.base_ptr + offset + half - 1) == 0
            assert read_in_child(tensor.base_ptr + offset + half) in (-signal.SIGSEGV, -signal.SIGBUS)

        tensor.resize_per_segment_(2 * half, zero_new=False)  # vLLM does not zero them
        assert driver.mapped_bytes == 2 * segments * half
        for i, offset in enumerate(tensor.segment_offsets):
            assert bool((full[offset + half : offset + 2 * half] == 0).all()), f"segment {i}: stale pages"
            assert bool((full[offset : offset + half] == i + 1).all())
    finally:
        tensor.free()
    assert driver.mapped_bytes == 0 and driver.reservations == {}


def test_extensible_tensor_is_grow_only_and_releases_all_or_nothing(driver: HostVmmDriver) -> None:
    """What vLLM offers for giving memory back: no shrink, and
    ``release_physical``, which unmaps every chunk (contents gone)."""
    tensor = ExtensibleTensor(4 * GRANULE * 4, device="cuda:0", num_segments=4)
    try:
        for size in (GRANULE, 2 * GRANULE, 4 * GRANULE):
            tensor.resize_per_segment_(size)
        chunks = tensor.num_physical_chunks
        assert chunks == 3 * 4  # one per segment per grow
        with pytest.raises(ValueError, match="grow-only"):
            tensor.resize_per_segment_(GRANULE)
        unmaps = driver.calls["unmap"]
        tensor.release_physical()
        assert driver.calls["unmap"] - unmaps == chunks
        assert driver.mapped_bytes == driver.physical_bytes == 0
        assert tensor.num_bytes == 0 and driver.reservations  # the address space stays
    finally:
        tensor.free()


def _kv_cache(num_layers: int, num_blocks: int, page: int) -> tuple[KVCacheConfig, KVCacheLayout]:
    """One KV cache tensor, layer-outermost (a segment per layer)."""
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    tensor = KVCacheTensor(
        size=num_layers * num_blocks * page, layers=layers, layer_stride=num_blocks * page, block_stride=page
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[]), KVCacheLayout.LBNHC


def test_extensible_kv_cache_shrink_remaps_the_whole_range(driver: HostVmmDriver) -> None:
    """``ExtensibleKVCache.commit(n, shrink=True)`` is vLLM's only way to a
    smaller footprint: it unmaps every chunk (release_physical), then maps
    and zeroes the smaller prefix, discarding what the kept blocks held."""
    num_layers, page = 4, GRANULE
    config, layout = _kv_cache(num_layers, num_blocks=16, page=page)
    cache = ExtensibleKVCache(config, torch.device("cuda:0"), layout)
    try:
        cache.commit(8)
        assert driver.mapped_bytes == cache.physical_bytes == cache.physical_bytes_for(8) == num_layers * 8 * page
        full = cache.buffer.full_view()
        for offset in cache.segment_offsets:
            full[offset : offset + 8 * page].fill_(7)
        chunks = cache.buffer.num_physical_chunks
        unmapped, mapped = driver.bytes_unmapped_total, driver.bytes_mapped_total
        before = rss_shmem()

        cache.commit(4, shrink=True)
        assert cache.num_committed_blocks == 4
        assert driver.bytes_unmapped_total - unmapped == num_layers * 8 * page  # all of it, not the top half
        assert driver.calls["unmap"] == chunks
        assert driver.bytes_mapped_total - mapped == num_layers * 4 * page  # the kept half, mapped again
        assert driver.mapped_bytes == driver.physical_bytes == num_layers * 4 * page
        assert abs(before - rss_shmem() - num_layers * 4 * page) <= RSS_SLACK
        for offset in cache.segment_offsets:
            assert bool((full[offset : offset + 4 * page] == 0).all()), "kept blocks were not discarded"

        cache.commit(2)  # without shrink: grow-only, nothing moves
        assert driver.mapped_bytes == num_layers * 4 * page
    finally:
        cache.free()


# -- the GPU check script's rules, run over the stand-in ------------------------


def _load_check_script(monkeypatch: pytest.MonkeyPatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "vmm_driver_check.py"
    spec = importlib.util.spec_from_file_location("vmm_driver_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_finds_every_rule_as_the_standin_enforces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/vmm_driver_check.py``'s rule checks, with the stand-in as
    the driver, all find the stand-in's behaviour: the script exercises each
    rule as the stand-in implements it, so a GPU run that differs names a
    rule where the stand-in departs from the driver."""
    import types

    check = _load_check_script(monkeypatch)
    standin = HostVmmDriver(GRANULE)

    def code_of(fn):
        try:
            return SUCCESS_CODE, fn()
        except VmmRuleError as e:
            return e.code, 0

    SUCCESS_CODE = 0
    total = 1 << 40

    class OverStandin(check.Driver):
        def __init__(self) -> None:  # no libcuda
            self.device, self.granularity = 0, standin.granularity(0)
            self.lib = types.SimpleNamespace(
                cuMemsetD8_v2=lambda ptr, value, n: ctypes.memset(ptr, value, n) and 0,
                cuCtxSynchronize=lambda: 0,
                cuMemcpyDtoH_v2=lambda out, ptr, n: ctypes.memmove(out, ptr, n) and 0,
            )

        def name(self, code: int) -> str:
            return "CUDA_SUCCESS" if code == 0 else standin.error_string(code)

        def reserve(self, size):
            return code_of(lambda: standin.reserve(size))

        def free_reserved(self, ptr, size):
            return code_of(lambda: standin.free_reserved(ptr, size))[0]

        def create(self, size):
            return code_of(lambda: standin.create(size, 0))

        def map(self, ptr, size, handle):
            return code_of(lambda: standin.map(ptr, size, handle))[0]

        def set_access(self, ptr, size):
            return code_of(lambda: standin.set_access(ptr, size, 0))[0]

        def unmap(self, ptr, size):
            return code_of(lambda: standin.unmap(ptr, size))[0]

        def release(self, handle):
            return code_of(lambda: standin.release(handle))[0]

        def free_bytes(self) -> int:
            return total - standin.physical_bytes

    try:
        checks = check.check_rules(OverStandin())
        assert len(checks) >= 10
        assert [c.name for c in checks if not c.matches] == []
        assert standin.mappings == {} and standin.handles == {} and standin.reservations == {}
    finally:
        standin.close()


def test_extensible_kv_cache_chunks_end_where_commits_stopped(driver: HostVmmDriver) -> None:
    """Each commit maps one chunk per segment over the blocks it adds, so the
    chunks' ends are where earlier commits stopped; a defragmenting commit
    remaps each segment as one chunk, leaving no tail that can be unmapped."""
    num_layers, page = 2, GRANULE
    config, layout = _kv_cache(num_layers, num_blocks=16, page=page)
    cache = ExtensibleKVCache(config, torch.device("cuda:0"), layout)
    try:
        for blocks in (1, 3, 10):
            cache.commit(blocks)
        sizes = sorted({size for _, size, _ in driver.mapped_ranges()})
        assert sizes == [1 * page, 2 * page, 7 * page]
        assert cache.buffer.num_physical_chunks == 3 * num_layers
        assert cache.buffer.segments_backed_by_one_chunk([10 * page] * num_layers) == [False] * num_layers

        unmaps = driver.calls["unmap"]
        cache.commit(10, defragment=True)
        assert driver.calls["unmap"] - unmaps == 3 * num_layers
        assert [size for _, size, _ in driver.mapped_ranges()] == [10 * page] * num_layers
        base = cache.buffer.base_ptr
        with pytest.raises(VmmRuleError, match="no sub-range"):
            driver.unmap(base + 8 * page, 2 * page)  # the top two blocks of layer 0
    finally:
        cache.free()
