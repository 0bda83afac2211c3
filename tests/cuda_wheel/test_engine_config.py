"""``EngineArgs(...).create_engine_config()`` of vLLM's CUDA wheel on a faked
GPU, through the plugin's hooks (installed when vLLM's ``arg_utils`` loaded):
the cap carried into the config, checked against the device's total memory
(NVML) and, with the weights, against its free memory, before any weights
load."""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.conftest import TEST_MAX_MODEL_LEN
from tests.cuda_wheel.conftest import FakeGPU, GiB
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError


def _engine_config(model: str, **kwargs):
    return EngineArgs(model=model, max_model_len=TEST_MAX_MODEL_LEN, **kwargs).create_engine_config()


def test_the_cap_reaches_the_cuda_engine_config(fake_gpu: FakeGPU, tiny_model: str) -> None:
    from vllm.platforms import current_platform

    config = _engine_config(tiny_model, kv_cache_max_memory="1G")
    assert current_platform.is_cuda()
    assert config.device_config.device.type == "cuda"
    cache_config = config.cache_config
    assert cache_config.kv_cache_max_memory == GiB
    assert cache_config.metrics_info()["kv_cache_max_memory"] == str(GiB)
    # The utilization the GPU worker's gate will read: a number whatever the
    # field holds (None by default on vLLM 0.34).
    utilization = getattr(cache_config, "resolved_gpu_memory_utilization", cache_config.gpu_memory_utilization)
    assert 0 < utilization <= 1


def test_without_a_cap_the_config_has_none(fake_gpu: FakeGPU, tiny_model: str) -> None:
    config = _engine_config(tiny_model)
    assert getattr(config.cache_config, "kv_cache_max_memory", None) is None


def test_a_cap_above_the_gpus_total_memory_is_refused(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """NVML's total (80 GiB here), read before anything loads."""
    with pytest.raises(KVCacheMaxMemoryError, match=r"total memory of the cuda:0 \(85899345920 bytes"):
        _engine_config(tiny_model, kv_cache_max_memory="100G")


def test_a_cap_that_cannot_fit_in_the_free_memory_is_refused_before_weights_load(
    fake_gpu: FakeGPU, tiny_model: str
) -> None:
    """NVML's free memory (512 MiB here, another process holding the rest)
    is less than the cap: refused in the first process, naming the GPU."""
    fake_gpu.free = 512 * 2**20
    with pytest.raises(KVCacheMaxMemoryError, match=fake_gpu.uuid):
        _engine_config(tiny_model, kv_cache_max_memory="1G")
    # The same cap fits once the memory is free.
    fake_gpu.free = fake_gpu.total
    assert _engine_config(tiny_model, kv_cache_max_memory="1G").cache_config.kv_cache_max_memory == GiB
