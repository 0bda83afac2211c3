"""The device's work in flight over the VMM stand-in's memory
(``tests/cuda_wheel/device_standin.py``): queued work touches the memory
only at a synchronize (or a wait on its event), and faults, as on a GPU,
where its memory was unmapped before it ran."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.cuda_wheel.device_standin import Device, DeviceFault
from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB

GRANULE = 2 * MiB


def _mapped(driver: HostVmmDriver, chunks: int) -> tuple[int, list[int]]:
    """A reservation of ``chunks`` granules, each mapped to its own handle
    with access; returns its base and the handles."""
    base = driver.reserve(chunks * GRANULE)
    handles = []
    for i in range(chunks):
        handle = driver.create(GRANULE, 0)
        driver.map(base + i * GRANULE, GRANULE, handle)
        driver.set_access(base + i * GRANULE, GRANULE, 0)
        handles.append(handle)
    return base, handles


def _device(driver: HostVmmDriver) -> Device:
    device = driver.device  # type: ignore[attr-defined]
    assert isinstance(device, Device)
    return device


def test_queued_work_touches_the_memory_only_when_the_host_synchronizes(driver: HostVmmDriver) -> None:
    device = _device(driver)
    base, _ = _mapped(driver, 2)
    first = device.write(base, 4096, 7, "forward step 1")
    read, _ = device.read(base, 4096, "offloading store")
    device.write(base + GRANULE, 4096, 9, "forward step 2")
    assert ctypes.string_at(base, 1) == b"\0" and read.data is None  # nothing has run

    device.wait(first)  # the first step's event: only what was queued up to it
    assert ctypes.string_at(base, 1) == b"\7"
    assert read.data is None and ctypes.string_at(base + GRANULE, 1) == b"\0"
    assert len(device.pending) == 2

    torch.accelerator.synchronize()  # what vLLM and the plugin call: the fixture's device
    assert read.data == b"\7" * 4096
    assert ctypes.string_at(base + GRANULE, 1) == b"\x09"
    assert device.pending == [] and device.ran == 3


def test_work_whose_memory_is_unmapped_before_it_runs_faults(driver: HostVmmDriver) -> None:
    device = _device(driver)
    base, handles = _mapped(driver, 2)
    device.write(base, 4096, 7, "forward step")
    device.read(base + GRANULE + 4096, 4096, "offloading store")
    driver.unmap(base + GRANULE, GRANULE)  # a release before the synchronize
    driver.release(handles[1])

    with pytest.raises(DeviceFault, match="illegal memory access") as fault:
        device.synchronize()
    assert fault.value.work == "offloading store"
    assert "was unmapped while it was in flight" in fault.value.why
    assert ctypes.string_at(base, 1) == b"\7"  # the work before it ran
    with pytest.raises(DeviceFault):  # the context is lost: every later call reports it
        torch.accelerator.synchronize()
    with pytest.raises(DeviceFault):
        device.write(base, 1, 1)


def test_memory_mapped_again_before_the_work_runs_is_still_gone_for_it(driver: HostVmmDriver) -> None:
    """Work queued for one mapping faults even if another is mapped at its
    address by the time it runs: the memory it was queued for went."""
    device = _device(driver)
    base, handles = _mapped(driver, 1)
    device.write(base, 4096, 7, "forward step")
    driver.unmap(base, GRANULE)
    driver.release(handles[0])
    handle = driver.create(GRANULE, 0)
    driver.map(base, GRANULE, handle)
    driver.set_access(base, GRANULE, 0)
    with pytest.raises(DeviceFault, match="forward step"):
        device.synchronize()
    assert ctypes.string_at(base, 1) == b"\0"


def test_work_over_memory_without_access_faults_and_never_touches_it(driver: HostVmmDriver) -> None:
    device = _device(driver)
    base = driver.reserve(2 * GRANULE)
    handle = driver.create(GRANULE, 0)
    driver.map(base, GRANULE, handle)  # mapped, no access yet
    device.write(base, 16, 1, "before set_access")
    with pytest.raises(DeviceFault, match="not mapped with access"):
        device.synchronize()

    other = Device(driver)
    other.read(base + GRANULE, 16, "above the mapping")  # reserved only
    with pytest.raises(DeviceFault, match="above the mapping"):
        other.synchronize()


def test_work_queued_before_an_unmap_that_runs_first_is_fine(driver: HostVmmDriver) -> None:
    """The synchronize a release makes before it unmaps: the work is done
    first and nothing faults."""
    device = _device(driver)
    base, handles = _mapped(driver, 2)
    read, _ = device.read(base + GRANULE, 4096, "offloading store")
    torch.accelerator.synchronize()
    driver.unmap(base + GRANULE, GRANULE)
    driver.release(handles[1])
    assert read.data == b"\0" * 4096 and device.fault is None
