"""vLLM's GPU worker sizing its KV cache budget: its start-up gate
(``request_memory``) and its real ``Worker.determine_available_memory``
(vLLM's ``memory_profiling`` over torch's readings), both as the plugin
wraps them, on a faked GPU another process shares.

No model can run here, so the model runner is represented by what its
profiling run does to the device: weights loaded after the start-up
snapshot, a transient activation peak. Everything the worker computes from
that is vLLM's own code, run on a config built by ``create_engine_config``
with vLLM's default utilization (None on 0.34)."""

from __future__ import annotations

import logging

import pytest
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.worker import gpu_worker as vllm_gpu_worker

from tests.conftest import TEST_MAX_MODEL_LEN
from tests.cuda_wheel.conftest import FakeGPU, GiB, bare_gpu_worker
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.hooks.wrap import WRAPPED
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

WEIGHTS = 2 * GiB
ACTIVATION_PEAK = 1 * GiB


class _ProfiledRunner:
    """The model runner as ``determine_available_memory`` uses it: its
    weights' size, and a profiling run that peaks above them on the device."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu = gpu
        self.model_memory_usage = WEIGHTS
        self.profile_runs = 0

    def profile_run(self, randomize_inputs: bool = False) -> None:
        self.profile_runs += 1
        self.gpu.allocate(0, peak=ACTIVATION_PEAK)

    def profile_cudagraph_memory(self) -> int:
        return 0


def _started_worker(gpu: FakeGPU, model: str, cap: str | None) -> vllm_gpu_worker.Worker:
    """vLLM's GPU worker after ``init_device`` and ``load_model``: its start-up
    snapshot and request taken through the plugin's gate, then its weights
    loaded. Built without ``__init__`` (no process group, no real device)."""
    config = EngineArgs(model=model, max_model_len=TEST_MAX_MODEL_LEN, kv_cache_max_memory=cap).create_engine_config()
    worker = bare_gpu_worker(config)
    gpu.allocate(WEIGHTS)
    worker.model_runner = _ProfiledRunner(gpu)
    return worker


@pytest.fixture(autouse=True)
def _native_allocator_settings_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker narrows the CUDA caching allocator's splitting around its
    profiling run; there is no CUDA allocator here to configure."""
    import torch

    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")


def test_the_plugin_wraps_the_workers_profiling() -> None:
    assert getattr(vllm_gpu_worker.Worker.determine_available_memory, WRAPPED, False)


def test_a_cap_within_what_the_instance_can_get_leaves_vllms_budget(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """20 of 80 GiB free at start-up: the gate asks for the free memory, and
    vLLM's budget after profiling is that less the weights and the
    activation peak; an 8 GiB cap fits in it and is recorded beside it."""
    fake_gpu.free = 20 * GiB
    worker = _started_worker(fake_gpu, tiny_model, "8G")
    gate = WorkerState.peek(worker.cache_config).gate
    assert gate is not None and gate.limited_by_free and gate.requested == worker.requested_memory
    assert 20 * GiB - 1 <= worker.requested_memory <= 20 * GiB

    budget = worker.determine_available_memory()
    assert worker.model_runner.profile_runs == 1
    assert budget == worker.requested_memory - WEIGHTS - ACTIVATION_PEAK
    decision = WorkerState.peek(worker.vllm_config.compilation_config).cap_decision
    assert decision is not None and (decision.cap, decision.budget) == (8 * GiB, budget)


def test_a_cap_above_what_the_instance_can_get_is_refused_after_profiling(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """The same device with an 18 GiB cap: vLLM's budget is 17 GiB, so the
    cap cannot bind as asked; the worker stops, naming the cap and what fits."""
    fake_gpu.free = 20 * GiB
    worker = _started_worker(fake_gpu, tiny_model, "18G")
    with pytest.raises(
        KVCacheMaxMemoryError, match=r"larger than what the cuda:0 can still give this instance"
    ) as raised:
        worker.determine_available_memory()
    assert "--kv-cache-max-memory 17" in str(raised.value)


def test_a_cap_within_the_tolerance_above_the_budget_gets_the_budget(
    fake_gpu: FakeGPU, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same device, the cap 0.5% above vLLM's 17 GiB budget (rounding,
    drift between readings): accepted; the KV cache gets the budget, and
    the worker says so in one INFO line."""
    fake_gpu.free = 20 * GiB
    cap = 17 * GiB + 17 * GiB // 200
    worker = _started_worker(fake_gpu, tiny_model, str(cap))
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        budget = worker.determine_available_memory()
    assert budget == worker.requested_memory - WEIGHTS - ACTIVATION_PEAK
    decision = WorkerState.peek(worker.vllm_config.compilation_config).cap_decision
    assert decision is not None and decision.kv_bytes == budget < cap
    lines = [r.getMessage() for r in caplog.records if "tolerance" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "within the 1% tolerance" in lines[0] and f"the KV cache gets the budget, {budget} bytes" in lines[0]


def test_a_cap_beyond_the_tolerance_above_the_budget_is_refused(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """1.5% above the same budget: refused after profiling, naming the cap."""
    fake_gpu.free = 20 * GiB
    cap = 17 * GiB + 17 * GiB * 15 // 1000
    worker = _started_worker(fake_gpu, tiny_model, str(cap))
    with pytest.raises(KVCacheMaxMemoryError, match=rf"^--kv-cache-max-memory \S+ \({cap} bytes") as raised:
        worker.determine_available_memory()
    assert "can still give this instance" in str(raised.value)


def test_without_a_cap_the_profiling_is_vllms_own(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """No cap: the plugin's wrappers only pass through (the device is free
    enough for vLLM's own gate)."""
    worker = _started_worker(fake_gpu, tiny_model, None)
    assert WorkerState.peek(worker.cache_config) is None
    budget = worker.determine_available_memory()
    assert budget == worker.requested_memory - WEIGHTS - ACTIVATION_PEAK
    assert WorkerState.peek(worker.vllm_config.compilation_config) is None
