#!/usr/bin/env python3
"""The CUDA driver's VMM API on a real GPU: time per call by chunk size, and
the rules the host-memory stand-in (``tests/cuda_wheel/vmm_standin.py``)
enforces, checked against the driver.

    python scripts/vmm_driver_check.py [--device 0] [--chunks-mib 2,8,32,128]
        [--repeats 20] [--json OUT.json]

Needs only ``libcuda.so.1`` (ctypes): no vLLM, no torch. Without the
library or a device it exits 2 with the reason.

Timings: per chunk size, ``--repeats`` rounds of cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap and cuMemRelease on one chunk, the median time
of each call; plus 128 chunks of 2 MiB created, mapped and granted, then
unmapped and released, as one grow and one shrink step (kvcached reports
about 4 ms to map 128 blocks on an A100).

Rules: each check runs the misuse and compares the driver's CUresult with
what the stand-in does. ``rule`` checks are what the stand-in enforces
(a mismatch exits 1); ``probe`` checks are behaviour the documentation
leaves open, recorded for the stand-in to follow.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

MiB = 1 << 20
SUCCESS = 0
INVALID_VALUE = 1

_MEM_ALLOCATION_TYPE_PINNED = 1
_MEM_LOCATION_TYPE_DEVICE = 1
_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _MemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _MemAllocFlags),
    ]


class _MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    def __init__(self, code: int, name: str, call: str) -> None:
        self.code = code
        super().__init__(f"{call}: {name} ({code})")


class Driver:
    """The VMM calls vLLM's ``CudaVmmDriver`` makes, returning CUresults."""

    def __init__(self, device: int) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SystemExit(f"libcuda.so.1 not found ({e}): this check needs an NVIDIA driver and GPU") from None
        lib = self.lib
        u64, size_t, p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorName": [ctypes.c_int, p(ctypes.c_char_p)],
            "cuDeviceGetCount": [p(ctypes.c_int)],
            "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuCtxSynchronize": [],
            "cuMemGetInfo_v2": [p(size_t), p(size_t)],
            "cuMemGetAllocationGranularity": [p(size_t), p(_MemAllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [p(u64), size_t, size_t, u64, u64],
            "cuMemAddressFree": [u64, size_t],
            "cuMemCreate": [p(u64), size_t, p(_MemAllocationProp), u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemSetAccess": [u64, size_t, p(_MemAccessDesc), size_t],
            "cuMemUnmap": [u64, size_t],
            "cuMemRelease": [u64],
            "cuMemsetD8_v2": [u64, ctypes.c_ubyte, size_t],
            "cuMemcpyDtoH_v2": [ctypes.c_void_p, u64, size_t],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.check("cuInit", lib.cuInit(0))
        count = ctypes.c_int()
        self.check("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(count)))
        if device >= count.value:
            raise SystemExit(f"device {device} not present ({count.value} CUDA device(s))")
        ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device))
        self.check("cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
        self.device = device
        self.prop = _MemAllocationProp()
        self.prop.type = _MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = _MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device
        self.access = _MemAccessDesc()
        self.access.location.type = _MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device
        self.access.flags = _MEM_ACCESS_FLAGS_PROT_READWRITE
        g = ctypes.c_size_t()
        self.check(
            "cuMemGetAllocationGranularity",
            lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self.prop), _MEM_ALLOC_GRANULARITY_MINIMUM),
        )
        self.granularity = g.value

    def name(self, code: int) -> str:
        s = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(s))
        return s.value.decode() if s.value else f"CUresult {code}"

    def check(self, call: str, code: int) -> None:
        if code != SUCCESS:
            raise CudaError(code, self.name(code), call)

    # Raw calls: the CUresult (and the value, where one is returned).
    def reserve(self, size: int) -> tuple[int, int]:
        ptr = ctypes.c_ulonglong()
        return self.lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), ptr.value

    def free_reserved(self, ptr: int, size: int) -> int:
        return self.lib.cuMemAddressFree(ptr, size)

    def create(self, size: int) -> tuple[int, int]:
        handle = ctypes.c_ulonglong()
        return self.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self.prop), 0), handle.value

    def map(self, ptr: int, size: int, handle: int) -> int:
        return self.lib.cuMemMap(ptr, size, 0, handle, 0)

    def set_access(self, ptr: int, size: int) -> int:
        return self.lib.cuMemSetAccess(ptr, size, ctypes.byref(self.access), 1)

    def unmap(self, ptr: int, size: int) -> int:
        return self.lib.cuMemUnmap(ptr, size)

    def release(self, handle: int) -> int:
        return self.lib.cuMemRelease(handle)

    def free_bytes(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check("cuMemGetInfo", self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        return free.value

    def ok(self, call: str, result: tuple[int, int] | int) -> int:
        code, value = result if isinstance(result, tuple) else (result, 0)
        self.check(call, code)
        return value


@dataclass
class Check:
    name: str
    kind: str  # "rule": the stand-in enforces it; "probe": recorded only
    standin: str
    driver: str
    matches: bool
    note: str = ""


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def time_calls(d: Driver, chunk: int, repeats: int) -> dict[str, float]:
    """Median seconds per call for one chunk of ``chunk`` bytes."""
    samples: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    ptr = d.ok("cuMemAddressReserve", d.reserve(chunk))
    try:
        for _ in range(repeats):
            t, result = timed(lambda: d.create(chunk))
            handle = d.ok("cuMemCreate", result)
            samples["create"].append(t)
            t, code = timed(lambda h=handle: d.map(ptr, chunk, h))
            d.ok("cuMemMap", code)
            samples["map"].append(t)
            t, code = timed(lambda: d.set_access(ptr, chunk))
            d.ok("cuMemSetAccess", code)
            samples["set_access"].append(t)
            t, code = timed(lambda: d.unmap(ptr, chunk))
            d.ok("cuMemUnmap", code)
            samples["unmap"].append(t)
            t, code = timed(lambda h=handle: d.release(h))
            d.ok("cuMemRelease", code)
            samples["release"].append(t)
    finally:
        d.free_reserved(ptr, chunk)
    return {k: statistics.median(v) for k, v in samples.items()}


def time_steps(d: Driver, chunk: int, count: int) -> dict[str, float]:
    """One grow (create + map per chunk, one set_access) and one shrink
    (unmap + release per chunk) of ``count`` chunks."""
    size = chunk * count
    base = d.ok("cuMemAddressReserve", d.reserve(size))
    try:
        t0 = time.perf_counter()
        handles = []
        for i in range(count):
            handle = d.ok("cuMemCreate", d.create(chunk))
            d.ok("cuMemMap", d.map(base + i * chunk, chunk, handle))
            handles.append(handle)
        d.ok("cuMemSetAccess", d.set_access(base, size))
        t1 = time.perf_counter()
        for i, handle in enumerate(handles):
            d.ok("cuMemUnmap", d.unmap(base + i * chunk, chunk))
            d.ok("cuMemRelease", d.release(handle))
        t2 = time.perf_counter()
    finally:
        d.free_reserved(base, size)
    return {"grow_s": t1 - t0, "shrink_s": t2 - t1}


def check_rules(d: Driver) -> list[Check]:
    g = d.granularity
    checks: list[Check] = []

    def add(name: str, kind: str, standin: str, code: int, expected: Callable[[int], bool], note: str = "") -> None:
        checks.append(Check(name, kind, standin, d.name(code), expected(code), note))

    def probe_refused(name: str, standin: str, code: int, note: str) -> bool:
        """A behaviour the documentation leaves open, expected refused; whether it was."""
        add(name, "probe", standin, code, lambda c: c != SUCCESS, note)
        return code != SUCCESS

    base = d.ok("cuMemAddressReserve", d.reserve(8 * g))
    h4 = d.ok("cuMemCreate", d.create(4 * g))
    d.ok("cuMemMap", d.map(base, 4 * g, h4))
    d.ok("cuMemSetAccess", d.set_access(base, 4 * g))

    code = d.unmap(base, g)
    add("cuMemUnmap of a sub-range of a mapping", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)
    if code == SUCCESS:  # the driver took it: leave the rest unmapped too
        d.unmap(base + g, 3 * g)
    other = d.ok("cuMemCreate", d.create(2 * g))
    code = d.map(base + 2 * g, 2 * g, other)
    add("cuMemMap over an existing mapping", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)
    if code == SUCCESS:
        d.unmap(base + 2 * g, 2 * g)

    code = d.map(base + 6 * g, 4 * g, other)
    add(
        "cuMemMap running past the reservation's end",
        "rule",
        "CUDA_ERROR_INVALID_VALUE",
        code,
        lambda c: c != SUCCESS,
        "size is also larger than the handle",
    )
    if code == SUCCESS:
        d.unmap(base + 6 * g, 4 * g)
    gone = d.ok("cuMemAddressReserve", d.reserve(2 * g))
    d.ok("cuMemAddressFree", d.free_reserved(gone, 2 * g))
    code = d.map(gone, 2 * g, other)
    add("cuMemMap outside any reservation", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)
    if code == SUCCESS:
        d.unmap(gone, 2 * g)

    code = d.map(base + 4 * g + g // 2, g, other) if g > 1 else INVALID_VALUE
    add("cuMemMap at an address off the granularity", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)
    code = d.set_access(base, 6 * g)
    add("cuMemSetAccess over a partly unmapped range", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)

    d.ok("cuMemMap", d.map(base + 4 * g, 2 * g, other))
    code = d.set_access(base, 6 * g)
    add(
        "cuMemSetAccess over two adjacent mappings at once",
        "rule",
        "CUDA_SUCCESS",
        code,
        lambda c: c == SUCCESS,
        "vLLM grants access per contiguous run of chunks",
    )
    spanning = "cuMemUnmap of a range spanning two whole mappings"
    asked = "the documentation asks for 'the entire contiguous address range that was mapped to'"
    if probe_refused(spanning, "CUDA_ERROR_INVALID_VALUE (one mapping per call)", d.unmap(base, 6 * g), asked):
        d.ok("cuMemUnmap", d.unmap(base + 4 * g, 2 * g))
    else:  # both went: map the first again for the next check
        d.ok("cuMemMap", d.map(base, 4 * g, h4))
        d.ok("cuMemSetAccess", d.set_access(base, 4 * g))
    d.ok("cuMemRelease", d.release(other))

    # Release while mapped: documented as allowed, the memory freed at the unmap.
    pattern = 0x5A
    d.check("cuMemsetD8", d.lib.cuMemsetD8_v2(base, pattern, 4 * g))
    d.check("cuCtxSynchronize", d.lib.cuCtxSynchronize())
    free_mapped = d.free_bytes()
    code = d.release(h4)
    free_released = d.free_bytes()
    out = (ctypes.c_ubyte * 16)()
    read = d.lib.cuMemcpyDtoH_v2(out, base + 4 * g - 16, 16)
    still_backed = read == SUCCESS and all(b == pattern for b in out)
    add(
        "cuMemRelease of a mapped handle",
        "rule",
        "CUDA_SUCCESS, memory kept until its unmap (strict_release=True refuses)",
        code,
        lambda c: c == SUCCESS and still_backed and free_released <= free_mapped,
        f"free memory {free_mapped} -> {free_released} bytes at the release; contents read back: {still_backed}",
    )
    code_unmap = d.unmap(base, 4 * g)
    free_unmapped = d.free_bytes()
    checks.append(
        Check(
            "cuMemUnmap of a released handle's last mapping frees it",
            "rule",
            "physical_bytes falls by the chunk",
            f"{d.name(code_unmap)}; free memory +{free_unmapped - free_released} bytes",
            code_unmap == SUCCESS and free_unmapped - free_released >= 4 * g,
        )
    )

    # A reservation freed with a mapping left in it.
    h = d.ok("cuMemCreate", d.create(2 * g))
    d.ok("cuMemMap", d.map(base + 6 * g, 2 * g, h))
    left = "cuMemAddressFree with a mapping left in it"
    if probe_refused(left, "CUDA_ERROR_INVALID_VALUE (refused)", d.free_reserved(base, 8 * g), "undocumented"):
        d.ok("cuMemUnmap", d.unmap(base + 6 * g, 2 * g))
        d.ok("cuMemRelease", d.release(h))
        d.ok("cuMemAddressFree", d.free_reserved(base, 8 * g))
    else:
        d.release(h)

    base = d.ok("cuMemAddressReserve", d.reserve(4 * g))
    code = d.free_reserved(base, 2 * g)
    add("cuMemAddressFree of part of a reservation", "rule", "CUDA_ERROR_INVALID_VALUE", code, lambda c: c != SUCCESS)
    if code != SUCCESS:
        d.ok("cuMemAddressFree", d.free_reserved(base, 4 * g))
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--chunks-mib", default="2,8,32,128")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    try:
        d = Driver(args.device)
    except SystemExit as e:
        print(f"vmm_driver_check: {e}", file=sys.stderr)
        return 2
    except CudaError as e:
        print(f"vmm_driver_check: no usable CUDA device: {e}", file=sys.stderr)
        return 2
    g = d.granularity
    print(f"device {args.device}, granularity {g // 1024} KiB")

    timings = []
    print("\n| chunk MiB | create us | map us | set_access us | unmap us | release us |")
    print("|---|---|---|---|---|---|")
    for mib in (int(x) for x in args.chunks_mib.split(",")):
        chunk = -(-mib * MiB // g) * g
        t = time_calls(d, chunk, args.repeats)
        timings.append({"chunk_mib": chunk / MiB, **t})
        cells = " | ".join(f"{1e6 * t[k]:.1f}" for k in ("create", "map", "set_access", "unmap", "release"))
        print(f"| {chunk / MiB:g} | {cells} |")
    steps = time_steps(d, max(g, 2 * MiB), 128)
    print(
        f"\n128 chunks of {max(g, 2 * MiB) // MiB} MiB: grow {1e3 * steps['grow_s']:.2f} ms, "
        f"shrink {1e3 * steps['shrink_s']:.2f} ms (kvcached reports about 4 ms to map 128 blocks)"
    )

    checks = check_rules(d)
    print("\n| check | kind | stand-in | driver | as the stand-in |")
    print("|---|---|---|---|---|")
    for c in checks:
        print(f"| {c.name} | {c.kind} | {c.standin} | {c.driver} | {'yes' if c.matches else 'NO'} |")
        if c.note:
            print(f"|   ({c.note}) | | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"granularity": g, "timings": timings, "steps": steps, "checks": [asdict(c) for c in checks]},
                f,
                indent=2,
            )
    broken = [c for c in checks if c.kind == "rule" and not c.matches]
    if broken:
        print(f"\n{len(broken)} rule(s) of the stand-in differ from the driver:", file=sys.stderr)
        for c in broken:
            print(f"  {c.name}: driver {c.driver}, stand-in {c.standin}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
