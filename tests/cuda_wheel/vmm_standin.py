"""A host-memory stand-in for vLLM 0.34's VMM driver (``vllm.utils.vmm_driver``).

:class:`HostVmmDriver` has the interface ``vllm.utils.extensible_tensor``
gets from ``get_vmm_driver()`` (``granularity``, ``reserve``,
``free_reserved``, ``create``, ``map``, ``set_access``, ``unmap``,
``release``, ``ensure_context``, ``unusable_runtime_reason``,
``error_string``, ``dlpack_device_type``), backed by host memory so that
vLLM's real ``ExtensibleTensor`` runs unchanged on the CPU:

- a reservation is an anonymous ``mmap(PROT_NONE)``, aligned to the
  granularity, like ``cuMemAddressReserve``: touching it faults (SIGSEGV);
- a handle is a ``memfd`` of the chunk's size, its pages allocated at
  ``create`` (``fallocate``) as ``cuMemCreate`` allocates device memory;
- ``map`` maps the memfd ``MAP_FIXED|MAP_SHARED`` over the reservation,
  still ``PROT_NONE``: as in CUDA, a new mapping has no access until
  ``set_access`` (``mprotect(PROT_READ|PROT_WRITE)``);
- ``unmap`` puts the reservation's ``PROT_NONE`` pages back over the range,
  so that the address space stays reserved, and the chunk's pages leave the
  process's resident set;
- ``dlpack_device_type`` is 1 (kDLCPU): ``uint8_tensor_from_ptr`` gives CPU
  tensors over the mapped memory.

It enforces the rules of CUDA's documentation (cuMemMap, cuMemUnmap,
cuMemSetAccess, cuMemRelease, cuMemAddressFree) and raises
:class:`VmmRuleError`, a ``RuntimeError`` like the one vLLM's driver
raises, naming the CUDA error and the rule:

- sizes, addresses and offsets are multiples of the granularity;
- ``map`` only inside one reservation, never over a mapping ("cuMemMap can
  only create mappings on VA range reservations that are not currently
  mapped"), at most the handle's size, and only of a live handle;
- ``set_access`` only over a fully mapped range;
- ``unmap`` only of a whole mapping ("cuMemUnmap cannot unmap a sub-range");
- ``release`` once per handle. The driver documents that a handle "can be
  freed when there are still outstanding mappings made with this handle",
  the memory being freed when the last mapping goes: so does the stand-in
  (counted in ``deferred_releases``). ``strict_release=True`` refuses it
  instead, for a caller that must never rely on it;
- ``free_reserved`` only of a whole reservation with nothing mapped in it
  (the documentation does not say what the driver does with mappings left
  in a freed reservation; ``scripts/vmm_driver_check.py`` finds out).

It counts the calls per method (:attr:`calls`) and tracks the bytes mapped
(:attr:`mapped_bytes`), the bytes of live physical memory
(:attr:`physical_bytes`: created handles not yet freed) and the bytes moved
(:attr:`bytes_mapped_total`, :attr:`bytes_unmapped_total`). The device's
work in flight over this memory is :class:`tests.cuda_wheel.device_standin.Device`,
which learns of each unmap (:attr:`unmap_listeners`).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

MiB = 1 << 20

DLPACK_CPU = 1  # kDLCPU

# CUresult codes the real driver returns for these misuses (cuda.h).
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_PERMITTED = 800
_ERROR_NAMES = {
    CUDA_ERROR_INVALID_VALUE: "CUDA_ERROR_INVALID_VALUE",
    CUDA_ERROR_OUT_OF_MEMORY: "CUDA_ERROR_OUT_OF_MEMORY",
    CUDA_ERROR_NOT_PERMITTED: "CUDA_ERROR_NOT_PERMITTED",
}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_PROT_NONE = 0


class VmmRuleError(RuntimeError):
    """A call the real driver would refuse: ``code`` is its CUresult,
    ``rule`` the rule broken (also in the message)."""

    def __init__(self, code: int, function: str, rule: str) -> None:
        self.code = code
        self.function = function
        self.rule = rule
        super().__init__(f"GPU driver error {code}: {_ERROR_NAMES.get(code, 'unknown error')}: {function}: {rule}")


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int = -1) -> int:
    ptr = _libc.mmap(addr or None, size, prot, flags, fd, 0)
    if ptr in (None, _MAP_FAILED):
        raise _os_error("mmap")
    return ptr


def _munmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size) != 0:
        raise _os_error("munmap")


def _mprotect(addr: int, size: int, prot: int) -> None:
    if _libc.mprotect(addr, size, prot) != 0:
        raise _os_error("mprotect")


def _reserve_pages(addr: int, size: int) -> int:
    """PROT_NONE address space (at addr, replacing what is there, if addr)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | (_MAP_FIXED if addr else 0)
    return _mmap(addr, size, _PROT_NONE, flags)


@dataclass
class _Handle:
    fd: int
    size: int
    device_index: int
    export_handle_types: int
    mappings: int = 0
    released: bool = False


class HostVmmDriver:
    """vLLM's ``VmmDriver`` interface over host memory; see the module's docstring."""

    dlpack_device_type = DLPACK_CPU

    def __init__(
        self,
        granularity: int = 2 * MiB,
        *,
        strict_release: bool = False,
        populate: bool = True,
        capacity: int | None = None,
    ) -> None:
        if granularity <= 0 or granularity % mmap.PAGESIZE:
            raise ValueError(f"granularity must be a positive multiple of the page size, got {granularity}")
        self._granularity = granularity
        self.strict_release = strict_release
        self.populate = populate
        """Allocate a handle's pages at ``create`` (``fallocate``), as
        ``cuMemCreate`` does; without it they are allocated when first touched."""
        self.capacity = capacity
        """The device's memory: ``create`` beyond it fails with
        CUDA_ERROR_OUT_OF_MEMORY, as on a full GPU (None: host memory's limit)."""
        self.calls: collections.Counter[str] = collections.Counter()
        self.reservations: dict[int, int] = {}
        """base address -> size"""
        self.mappings: dict[int, tuple[int, int]] = {}
        """address -> (size, handle)"""
        self.handles: dict[int, _Handle] = {}
        """Live handles: not yet released, or released and still mapped."""
        self.deferred_releases = 0
        self.bytes_mapped_total = 0
        self.bytes_unmapped_total = 0
        self.accessible: set[int] = set()
        """Addresses of the mappings ``set_access`` made readable and writable."""
        self.unmap_listeners: list[Callable[[int, int], None]] = []
        """Called with ``(address, size)`` of each mapping as it is unmapped."""
        self._next_handle = 1
        self._lock = threading.Lock()

    # -- readings --------------------------------------------------------

    @property
    def mapped_bytes(self) -> int:
        return sum(size for size, _ in self.mappings.values())

    @property
    def physical_bytes(self) -> int:
        """Bytes of handles whose memory is not freed yet."""
        return sum(h.size for h in self.handles.values())

    def mapped_ranges(self) -> list[tuple[int, int, int]]:
        """(address, size, handle) of each mapping, by address."""
        return sorted((addr, size, handle) for addr, (size, handle) in self.mappings.items())

    # -- the driver's interface -------------------------------------------

    def granularity(self, device_index: int) -> int:
        self.calls["granularity"] += 1
        return self._granularity

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        self.calls["unusable_runtime_reason"] += 1
        return None

    def ensure_context(self, device_index: int) -> None:
        self.calls["ensure_context"] += 1

    def error_string(self, code: int) -> str:
        return _ERROR_NAMES.get(code, "unknown error")

    def reserve(self, size: int) -> int:
        self.calls["reserve"] += 1
        self._aligned("cuMemAddressReserve", size=size)
        g = self._granularity
        # Over-reserve, then trim both ends, for a granularity-aligned base.
        raw = _reserve_pages(0, size + g)
        base = (raw + g - 1) // g * g
        if base > raw:
            _munmap(raw, base - raw)
        if raw + size + g > base + size:
            _munmap(base + size, raw + size + g - (base + size))
        with self._lock:
            self.reservations[base] = size
        return base

    def free_reserved(self, ptr: int, size: int) -> None:
        self.calls["free_reserved"] += 1
        with self._lock:
            if self.reservations.get(ptr) != size:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemAddressFree",
                    f"a reservation is freed whole: [{ptr:#x}, +{size:#x}) is not one reserved by cuMemAddressReserve",
                )
            inside = [addr for addr in self.mappings if ptr <= addr < ptr + size]
            if inside:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemAddressFree",
                    f"a reservation is freed only when nothing is mapped in it: {len(inside)} mapping(s) left",
                )
            del self.reservations[ptr]
        _munmap(ptr, size)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        self.calls["create"] += 1
        self._aligned("cuMemCreate", size=size)
        if size == 0:
            raise VmmRuleError(CUDA_ERROR_INVALID_VALUE, "cuMemCreate", "size must be positive")
        if self.capacity is not None and self.physical_bytes + size > self.capacity:
            raise VmmRuleError(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "out of memory")
        fd = os.memfd_create("vmm-standin", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            if self.populate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise VmmRuleError(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "out of memory") from e
                    raise
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            handle = self._next_handle
            self._next_handle += 1
            self.handles[handle] = _Handle(fd, size, device_index, export_handle_types)
        return handle

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.calls["map"] += 1
        self._aligned("cuMemMap", ptr=ptr, size=size)
        with self._lock:
            h = self.handles.get(handle)
            if h is None or h.released:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE, "cuMemMap", f"handle {handle} is not a live handle from cuMemCreate"
                )
            if size == 0 or size > h.size:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemMap",
                    f"offset + size must be within the allocation: {size:#x} mapped of a {h.size:#x}-byte handle",
                )
            if self._reservation_of(ptr, size) is None:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemMap",
                    f"maps only inside a reservation: [{ptr:#x}, +{size:#x}) is not within one cuMemAddressReserve range",
                )
            for addr, (msize, _) in self.mappings.items():
                if addr < ptr + size and ptr < addr + msize:
                    raise VmmRuleError(
                        CUDA_ERROR_INVALID_VALUE,
                        "cuMemMap",
                        f"never over an existing mapping: [{ptr:#x}, +{size:#x}) overlaps the mapping at {addr:#x}",
                    )
            _mmap(ptr, size, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, h.fd)
            self.mappings[ptr] = (size, handle)
            h.mappings += 1
            self.bytes_mapped_total += size

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        self.calls["set_access"] += 1
        self._aligned("cuMemSetAccess", ptr=ptr, size=size)
        with self._lock:
            covered = ptr
            for addr, msize, _ in self.mapped_ranges():
                if addr <= covered < addr + msize:
                    covered = addr + msize
                if covered >= ptr + size:
                    break
            if size == 0 or covered < ptr + size:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemSetAccess",
                    f"the range must be fully mapped: [{ptr:#x}, +{size:#x}) is unmapped from {covered:#x}",
                )
            _mprotect(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE)
            self.accessible.update(addr for addr in self.mappings if ptr <= addr < ptr + size)

    def unmap(self, ptr: int, size: int) -> None:
        self.calls["unmap"] += 1
        self._aligned("cuMemUnmap", ptr=ptr, size=size)
        with self._lock:
            mapping = self.mappings.get(ptr)
            if mapping is None or mapping[0] != size:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    "cuMemUnmap",
                    f"unmaps only a whole mapping, no sub-range: [{ptr:#x}, +{size:#x}) is not one cuMemMap range",
                )
            # Back to reserved address space: the pages leave the process.
            _reserve_pages(ptr, size)
            del self.mappings[ptr]
            self.accessible.discard(ptr)
            h = self.handles[mapping[1]]
            h.mappings -= 1
            self.bytes_unmapped_total += size
            if h.released and h.mappings == 0:
                self._free_handle(mapping[1])
        for listener in self.unmap_listeners:
            listener(ptr, size)

    def release(self, handle: int) -> None:
        self.calls["release"] += 1
        with self._lock:
            h = self.handles.get(handle)
            if h is None or h.released:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE, "cuMemRelease", f"handle {handle} is not a live handle from cuMemCreate"
                )
            if h.mappings:
                if self.strict_release:
                    raise VmmRuleError(
                        CUDA_ERROR_NOT_PERMITTED,
                        "cuMemRelease",
                        f"release a handle only after it is unmapped (strict_release): handle {handle} has {h.mappings} mapping(s)",
                    )
                # As the driver documents: the memory is freed at the last unmap.
                h.released = True
                self.deferred_releases += 1
                return
            self._free_handle(handle)

    # -- helpers ---------------------------------------------------------

    def close(self) -> None:
        """Unmap, release and free everything left (a test's teardown)."""
        for addr, size, _ in self.mapped_ranges():
            self.unmap(addr, size)
        for handle, h in list(self.handles.items()):
            if not h.released:
                self.release(handle)
        for base, size in list(self.reservations.items()):
            self.free_reserved(base, size)

    def _free_handle(self, handle: int) -> None:
        os.close(self.handles.pop(handle).fd)

    def _reservation_of(self, ptr: int, size: int) -> int | None:
        for base, rsize in self.reservations.items():
            if base <= ptr and ptr + size <= base + rsize:
                return base
        return None

    def _aligned(self, function: str, **values: int) -> None:
        g = self._granularity
        for name, value in values.items():
            if value < 0 or value % g:
                raise VmmRuleError(
                    CUDA_ERROR_INVALID_VALUE,
                    function,
                    f"{name} must be a multiple of the granularity ({g:#x}): got {value:#x}",
                )
