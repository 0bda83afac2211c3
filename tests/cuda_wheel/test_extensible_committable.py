"""What a run-time limit may commit and what it says where it returns no
memory, on vLLM 0.34's real ``ExtensibleKVCache`` (issue 49, items 2 and 9):
vLLM's ``measure_kv_cache_blocks``, ``extend_kv_cache``,
``ExtensibleKVCache.committable_blocks``, ``BlockPool`` and ``Scheduler``
run through the plugin; only the VMM driver is the host-memory stand-in
and the device's free memory the faked GPU's reading.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout

from tests.cuda_wheel import test_extensible_resize as resize
from tests.cuda_wheel import test_resize_scheduler as sched
from tests.cuda_wheel.conftest import FakeGPU
from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.hooks.runtime.limit import RuntimeLimit
from vllm_kv_cache_limit.hooks.runtime.utility_methods import start_at
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.logic import envs, limit_math

LOGGER = "vllm.plugins.kv_cache_limit"
PAGE = resize.PAGE
LAYERS = resize.LAYERS
HEADS = 8


def _engine(
    tiny_model: str,
    num_blocks: int = resize.NUM_BLOCKS,
    layout: KVCacheLayout = KVCacheLayout.LBNHC,
    cap: int | None = None,
    measure_with: FakeGPU | None = None,
) -> EngineCore:
    """As ``test_extensible_resize._engine``, for any layout and block count:
    under LHBNC each layer holds one segment per KV head, of ``num_blocks``
    blocks of a head's share of a page."""
    sched.NUM_BLOCKS = num_blocks  # restored by the caller's monkeypatch
    scheduler = sched._scheduler(tiny_model)
    stride = PAGE // HEADS if layout is KVCacheLayout.LHBNC else PAGE
    tensor = KVCacheTensor(
        size=len(LAYERS) * num_blocks * PAGE, layers=list(LAYERS), layer_stride=num_blocks * PAGE, block_stride=stride
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), resize.SPEC)],
    )
    vllm_config = scheduler.vllm_config
    vllm_config.cache_config.enable_extensible_kv_cache = True
    vllm_config.cache_config.kv_cache_max_memory = cap
    return resize.extended_core(scheduler, config, layout, cap, num_blocks, measure_with)


def _plugin_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def _measured_engine(fake_gpu: FakeGPU, tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    """Warmup left room for fewer blocks than the cap (vLLM keeps 1 GiB free:
    about 20 MiB for the cache); the engine starts at what it measured."""
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device=None: None)
    monkeypatch.setattr(sched, "NUM_BLOCKS", resize.NUM_BLOCKS)
    fake_gpu.free = (1 << 30) + 20 * MiB
    core = _engine(tiny_model, cap=resize.NUM_BLOCKS * resize.BYTES_PER_BLOCK, measure_with=fake_gpu)
    measured = WorkerState.peek(resize._cache(core)).measured
    assert 100 < measured < 2 * resize.BLOCKS_PER_CHUNK < resize.NUM_BLOCKS
    start_at(core, measured)
    return core


def test_a_raise_past_what_vllm_can_commit_is_refused_and_grows_once_the_device_frees_memory(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine started at the blocks warmup measured; vLLM's
    ``committable_blocks`` says no more fit beside the memory it keeps for
    activations, so a raise to the cap is refused (quoting the size and
    naming the largest accepted, which is accepted) and nothing is mapped;
    once the device has more free memory the same raise commits it."""
    core = _measured_engine(fake_gpu, tiny_model, monkeypatch)
    try:
        cache = resize._cache(core)
        measured = WorkerState.peek(cache).measured
        assert cache.committable_blocks() == measured  # the premise: vLLM says no more blocks fit
        mapped = driver.mapped_bytes
        asked = resize.NUM_BLOCKS * resize.BYTES_PER_BLOCK

        status = resize._set(core, resize.NUM_BLOCKS)
        assert limit_math.is_error(status), status
        most = measured * resize.BYTES_PER_BLOCK
        assert f"({asked} bytes)" in status["error"] and f"({most} bytes)" in status["error"], status
        assert driver.mapped_bytes == mapped and cache.num_committed_blocks == measured
        limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool)
        assert limit.limit == measured

        shown = core.kv_cache_limit_status()
        assert shown["kv_cache_committable_bytes"] == most, shown
        assert not limit_math.is_error(core.kv_cache_limit_set(most, "drain"))  # the suggested size is accepted

        fake_gpu.free += 2 << 30  # a neighbour left
        assert not limit_math.is_error(resize._set(core, resize.NUM_BLOCKS))
        assert cache.num_committed_blocks == resize.NUM_BLOCKS
        assert driver.mapped_bytes == resize.NUM_BLOCKS * resize.BYTES_PER_BLOCK
        assert core.kv_cache_limit_status()["kv_cache_committable_bytes"] == asked
    finally:
        resize._cache(core).free()


def test_the_autoscaler_grows_no_further_than_vllm_can_commit(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A demand above what the device can back beside vLLM's activation
    headroom: the autoscaler's limit stops at the committable blocks, not
    at its ceiling (the cap), and the mapped memory with it."""
    monkeypatch.setenv(envs.LOCK_DIR, str(tmp_path))
    core = _measured_engine(fake_gpu, tiny_model, monkeypatch)
    scaler = None
    try:
        cache = resize._cache(core)
        measured = WorkerState.peek(cache).measured
        cache_config = core.vllm_config.cache_config
        setattr(cache_config, autoscaler.AUTOSCALE, True)
        setattr(cache_config, autoscaler.MIN_MEMORY, None)
        setattr(cache_config, autoscaler.SHARED_BUDGET, None)
        start_autoscaling(core)
        scaler = resize._scaler(core)
        scaler.stop.set()
        if scaler.timer is not None:
            scaler.timer.join(timeout=5)
        assert scaler.ceiling == resize.NUM_BLOCKS
        sched._add(core, [str(i) for i in range(60)], max_tokens=1000)  # 8 blocks each: 480 blocks
        core.step()
        resize._decide(core, time.monotonic() + 1)
        limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool)
        assert limit.limit == measured
        assert cache.num_committed_blocks == measured
        assert driver.mapped_bytes == cache.physical_bytes_for(measured)
    finally:
        if scaler is not None:
            scaler.close()
        resize._cache(core).free()


def test_without_a_cap_a_lower_limit_says_once_in_one_line_that_the_memory_stays(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.setattr(sched, "NUM_BLOCKS", resize.NUM_BLOCKS)
    core = _engine(tiny_model, cap=None)
    try:
        mapped = driver.mapped_bytes
        assert mapped == resize.NUM_BLOCKS * resize.BYTES_PER_BLOCK  # the premise: all of it mapped, unchunked
        with caplog.at_level(logging.INFO, logger=LOGGER):
            for blocks in (resize.LIMIT, resize.NUM_BLOCKS, resize.LIMIT):
                status = resize._set(core, blocks)
                assert not limit_math.is_error(status), status
                assert status["released_bytes"] == 0
        assert driver.mapped_bytes == mapped
        records = _plugin_records(caplog)
        assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
        said = [r.getMessage() for r in records if "not mapped in chunks" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0], caplog.text
        assert "--kv-cache-max-memory" in said[0]
    finally:
        resize._cache(core).free()


def test_a_layout_without_a_chunk_plan_keeps_its_memory_and_says_why_in_one_line(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """LHBNC (ROCm's rocm_attn and rocm_aiter_fa) puts a segment per layer
    and head whose starts are not on the driver's granularity: no chunk
    plan. As docs/resize.md says, the limit is then logical: the memory
    stays mapped, released_bytes is 0, and one warning at start-up names
    the layout and the layout that returns memory."""
    num_blocks = 500  # a head's segment: 500 x 8 KiB, not a whole number of 2 MiB granules
    monkeypatch.setattr(sched, "NUM_BLOCKS", num_blocks)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        core = _engine(tiny_model, num_blocks, KVCacheLayout.LHBNC, cap=num_blocks * resize.BYTES_PER_BLOCK)
    try:
        cache = resize._cache(core)
        assert any(offset % resize.GRANULE for offset in cache.segment_offsets)  # the premise
        core.model_executor.worker.model_runner.extensible_kv_cache = cache
        warnings = [r.getMessage() for r in _plugin_records(caplog) if r.levelno == logging.WARNING]
        assert len(warnings) == 1, caplog.text
        assert "LHBNC" in warnings[0] and "VLLM_KV_CACHE_LAYOUT=LBHNC" in warnings[0], warnings
        assert "Turn that off" not in warnings[0]
        caplog.clear()
        mapped = driver.mapped_bytes
        with caplog.at_level(logging.INFO, logger=LOGGER):
            for blocks in (resize.LIMIT, 400, resize.LIMIT):
                status = core.kv_cache_limit_set(blocks * resize.BYTES_PER_BLOCK, "drain")
                assert not limit_math.is_error(status), status
                assert status["released_bytes"] == 0
        assert driver.mapped_bytes == mapped
        records = _plugin_records(caplog)
        assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
        said = [r.getMessage() for r in records if "not mapped in chunks" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0] and "LHBNC" in said[0], caplog.text
    finally:
        resize._cache(core).free()
