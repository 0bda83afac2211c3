"""vLLM's GPU start-up gate (``request_memory``, which the GPU worker calls in
``init_device``) with vLLM's own default ``CacheConfig``, through the
plugin's wrapper, on a faked GPU. vLLM 0.34's ``gpu_memory_utilization``
defaults to None and vLLM reads ``resolved_gpu_memory_utilization``; the
plugin must read, and lower, the value vLLM resolves."""

from __future__ import annotations

import math

import pytest
from vllm.config import CacheConfig
from vllm.utils.mem_utils import MemorySnapshot
from vllm.v1.worker import gpu_worker as vllm_gpu_worker
from vllm.v1.worker.utils import request_memory

from tests.cuda_wheel.conftest import FakeGPU, GiB
from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.hooks.cap import gpu_worker
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.hooks.wrap import WRAPPED

CAP = 8 * GiB
RESOLVED = "resolved_gpu_memory_utilization"
"""vLLM 0.34's property: the utilization its own code reads."""


def _resolved(config: CacheConfig) -> float:
    """The utilization vLLM's own code reads from ``config``."""
    return getattr(config, RESOLVED, config.gpu_memory_utilization)


def _capped(config: CacheConfig, cap: int | None = CAP) -> CacheConfig:
    """``config`` carrying the cap, as ``create_engine_config`` leaves it."""
    config.kv_cache_max_memory = cap
    return config


def _snapshot() -> MemorySnapshot:
    """vLLM's own snapshot of the (faked) device, as ``init_device`` takes it."""
    return MemorySnapshot(device="cuda:0")


def test_the_worker_module_calls_the_plugins_gate() -> None:
    """The premise of the tier: importing vLLM's GPU worker module installed
    the plugin's wrapper over the ``request_memory`` it calls."""
    assert vllm_gpu_worker.request_memory is not request_memory
    assert getattr(vllm_gpu_worker.request_memory, WRAPPED, False)
    assert vllm_gpu_worker.request_memory.__wrapped__ is request_memory


def test_default_cache_config_with_a_cap_asks_for_the_free_memory(fake_gpu: FakeGPU) -> None:
    """vLLM's default ``CacheConfig()`` (0.34: utilization None) through the
    worker module's ``request_memory``: with a cap and 20 of 80 GiB free the
    instance asks for the free memory, where vLLM alone refuses to start."""
    fake_gpu.free = 20 * GiB  # another process holds 60 GiB
    snapshot = _snapshot()
    assert (snapshot.free_memory, snapshot.total_memory) == (20 * GiB, 80 * GiB)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        vllm_gpu_worker.request_memory(snapshot, _capped(CacheConfig(), None))  # no cap: vLLM's own refusal

    config = _capped(CacheConfig())
    given = config.gpu_memory_utilization
    requested = vllm_gpu_worker.request_memory(snapshot, config, 0)
    assert 20 * GiB - 1 <= requested <= 20 * GiB
    assert config.gpu_memory_utilization == given  # the caller's config is untouched
    gate = WorkerState.peek(config).gate
    assert gate is not None and gate.limited_by_free
    assert (gate.free, gate.total, gate.requested, gate.device) == (20 * GiB, 80 * GiB, requested, "cuda:0")


def test_default_cache_config_with_a_cap_on_a_free_device_is_vllms_own_request(fake_gpu: FakeGPU) -> None:
    fake_gpu.free = 79 * GiB
    snapshot = _snapshot()
    expected = request_memory(snapshot, CacheConfig())
    assert expected == math.ceil(80 * GiB * _resolved(CacheConfig()))
    config = _capped(CacheConfig())
    assert gpu_worker._ceiling_request_memory(request_memory)(snapshot, config) == expected
    gate = WorkerState.peek(config).gate
    assert gate is not None and not gate.limited_by_free


_NO_EXTENSIBLE = pytest.mark.skipif(
    "enable_extensible_kv_cache" not in CacheConfig.__dataclass_fields__,
    reason="no extensible KV cache in this vLLM (0.34+)",
)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="default"),
        pytest.param({"gpu_memory_utilization": 0.9}, id="utilization-0.9"),
        pytest.param({"enable_extensible_kv_cache": True}, id="extensible", marks=_NO_EXTENSIBLE),
        pytest.param({"enable_extensible_kv_cache": False}, id="not-extensible", marks=_NO_EXTENSIBLE),
    ],
)
def test_the_lowered_utilization_is_what_vllm_resolves(fake_gpu: FakeGPU, settings: dict) -> None:
    """What vLLM's ``request_memory`` reads from the config the plugin hands
    it is the ceiling (free / total), whichever way the utilization was
    given or defaulted."""
    fake_gpu.free = 20 * GiB
    seen: list[float] = []

    def spy(init_snapshot, cache_config, *args):
        seen.append(_resolved(cache_config))
        return request_memory(init_snapshot, cache_config, *args)

    config = _capped(CacheConfig(**settings))
    before = config.gpu_memory_utilization
    requested = gpu_worker._ceiling_request_memory(spy)(_snapshot(), config, 0)
    assert seen == [pytest.approx(20 / 80)]
    assert requested == math.ceil(80 * GiB * seen[0])
    assert config.gpu_memory_utilization == before  # the caller's config is untouched


def test_compat_reads_and_sets_what_vllm_resolves() -> None:
    """``compat.gpu_memory_utilization`` is the value vLLM's own code reads
    (``resolved_gpu_memory_utilization`` where vLLM has it), and
    ``set_gpu_memory_utilization`` changes that value."""
    config = CacheConfig()
    assert isinstance(_resolved(config), float)
    assert compat.gpu_memory_utilization(config) == _resolved(config)
    compat.set_gpu_memory_utilization(config, 0.25)
    assert _resolved(config) == 0.25
    assert compat.gpu_memory_utilization(config) == 0.25
