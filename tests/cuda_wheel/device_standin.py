"""The device's work in flight, over the host-memory VMM stand-in
(``tests/cuda_wheel/vmm_standin.py``).

A GPU runs what the host queues (a forward step's KV writes, an offloading
connector's copies out of the KV cache) later, in order; the host sees it
done only after a synchronize, or an event it waits on. :class:`Device`
keeps that: :meth:`Device.write` and :meth:`Device.read` queue work over an
address range and return at once; nothing touches the memory until
:meth:`Device.wait` or :meth:`Device.synchronize` runs the work queued up to
then. Work whose memory was unmapped after it was queued (a release before
the synchronize), or that finds its range not mapped with access when it
runs, faults as the GPU does: :class:`DeviceFault` ("an illegal memory
access was encountered") from that wait or synchronize, and from every one
after (the CUDA context is lost); the rest of the queue is dropped. Work
never touches memory that is not mapped: the fault is raised before.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tests.cuda_wheel.vmm_standin import HostVmmDriver


class DeviceFault(RuntimeError):
    """What CUDA reports when a kernel or copy touched memory that is not
    mapped: the context is lost, and every later call reports it."""

    def __init__(self, work: str, why: str) -> None:
        self.work = work
        self.why = why
        super().__init__(f"CUDA error: an illegal memory access was encountered ({work}: {why})")


@dataclass
class Work:
    """One queued operation over ``ranges`` (``(address, size)``); ``run``
    does it once the memory is checked. ``gone``: why its memory went
    before it ran, if it did."""

    name: str
    ranges: list[tuple[int, int]]
    run: Callable[[], object]
    seq: int
    gone: str | None = None


@dataclass
class Read:
    """The bytes a queued read copied out (``None`` until it has run)."""

    data: bytes | None = None


class Device:
    """One device's queue of work in flight over ``driver``'s memory; see
    the module's docstring."""

    def __init__(self, driver: HostVmmDriver) -> None:
        self.driver = driver
        self.pending: list[Work] = []
        self.fault: DeviceFault | None = None
        self.ran = 0
        """Operations run so far."""
        self._seq = itertools.count(1)
        self._last = 0
        driver.unmap_listeners.append(self._unmapped)

    def write(self, addr: int, size: int, value: int, name: str = "write") -> int:
        """Queue filling ``[addr, addr+size)`` with the byte ``value``;
        returns an event that :meth:`wait` takes."""
        return self._queue(name, [(addr, size)], lambda: ctypes.memset(addr, value, size))

    def read(self, addr: int, size: int, name: str = "read") -> tuple[Read, int]:
        """Queue a copy of ``[addr, addr+size)`` out of the device memory
        (as an offloading store does); the bytes are in the result once
        it has run."""
        result = Read()

        def run() -> None:
            result.data = ctypes.string_at(addr, size)

        return result, self._queue(name, [(addr, size)], run)

    def record(self) -> int:
        """An event after everything queued so far."""
        return self._last

    def wait(self, event: int) -> None:
        """Run the work queued up to ``event`` (an event's synchronize)."""
        self._raise_lost()
        while self.pending and self.pending[0].seq <= event:
            self._run(self.pending.pop(0))

    def synchronize(self, device: object = None) -> None:
        """Run everything queued (``torch.accelerator.synchronize``)."""
        self.wait(self._last)

    def touching(self, start: int, end: int) -> list[Work]:
        """The queued work that touches ``[start, end)``."""
        return [w for w in self.pending if any(a < end and start < a + s for a, s in w.ranges)]

    def _queue(self, name: str, ranges: list[tuple[int, int]], run: Callable[[], object]) -> int:
        self._raise_lost()
        self._last = next(self._seq)
        self.pending.append(Work(name, ranges, run, self._last))
        return self._last

    def _unmapped(self, addr: int, size: int) -> None:
        for work in self.touching(addr, addr + size):
            work.gone = work.gone or f"[{addr:#x}, +{size:#x}) was unmapped while it was in flight"

    def _run(self, work: Work) -> None:
        why = work.gone or self._unmapped_in(work.ranges)
        if why is not None:
            self.fault = DeviceFault(work.name, why)
            self.pending.clear()
            raise self.fault
        work.run()
        self.ran += 1

    def _unmapped_in(self, ranges: list[tuple[int, int]]) -> str | None:
        """Why some byte of ``ranges`` is not mapped with access now (None: all are)."""
        mapped = sorted(
            (addr, addr + size) for addr, (size, _) in self.driver.mappings.items() if addr in self.driver.accessible
        )
        for start, size in ranges:
            covered = start
            for lo, hi in mapped:
                if lo <= covered < hi:
                    covered = hi
            if covered < start + size:
                return f"{covered:#x} in [{start:#x}, +{size:#x}) is not mapped with access"
        return None

    def _raise_lost(self) -> None:
        if self.fault is not None:
            raise self.fault
