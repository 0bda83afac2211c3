"""A release of GPU memory above a run-time limit waits for the device's
work in flight (vLLM 0.34's extensible KV cache).

With async scheduling, vLLM's engine core (``step_with_batch_queue``)
queues step N+1 on the device before it processes step N's output: a
request that finishes in step N frees its blocks while step N+1, which
scheduled it once more, still writes its KV blocks. The release that
follows, between steps, must let that write run before it unmaps the
chunks. Real: vLLM's ``AsyncScheduler``, ``EngineCore.step_with_batch_queue``,
``ExtensibleKVCache`` and ``ExtensibleTensor``, and the plugin's hooks and
worker methods. Faked: the device, as work in flight over the VMM
stand-in's memory (``tests/cuda_wheel/device_standin.py``): each step's KV
writes are queued, and run when the engine core waits for that step's
sampled tokens (its event) or on a synchronize; a write whose memory went
first faults.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from typing import Any

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import ModelRunnerOutput

from tests.cuda_wheel import test_extensible_resize as ext
from tests.cuda_wheel import test_resize_scheduler as sched
from tests.cuda_wheel.conftest import FakeGPU
from tests.cuda_wheel.device_standin import Device
from tests.cuda_wheel.vmm_standin import HostVmmDriver
from vllm_kv_cache_limit.logic import limit_math

WRITTEN = 5
"""The byte a forward step writes into the KV blocks of the tokens it computes."""


class _DeviceFuture(Future):
    """A step's sampled tokens: ready once the device ran the step (its event)."""

    def __init__(self, device: Device, event: int, output: Any) -> None:
        super().__init__()
        self.device, self.event, self.output = device, event, output

    def result(self, timeout: float | None = None) -> Any:
        self.device.wait(self.event)
        return self.output


class _AsyncWorkers(ext._Workers):
    """The executor of one CUDA worker under async scheduling: each step's
    forward pass is queued on the device (a write to every KV block of the
    tokens it computes, in every layer) and its output waits for it."""

    def __init__(self, worker: Any, device: Device) -> None:
        super().__init__(worker)
        self.device = device
        self.tables: dict[str, list[int]] = {}
        self.written: list[tuple[str, int]] = []
        """(request, block) of each write queued, in order."""
        self.in_flight_at_release: list[list[tuple[str, int]]] = []
        """For each release of chunks: the writes still queued over them."""
        self.sampled: collections.Counter[str] = collections.Counter()
        self.eos_at: dict[str, int] = {}
        """Request -> the token it samples EOS at (1: its first), which
        stops it; the others sample a token that does not stop them."""
        self._output: Any = None

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        if method == "kv_cache_limit_pages" and args[2]:  # a release: what is in flight over its blocks
            keep, num_blocks = args[0], args[1]
            self.in_flight_at_release.append(self._queued_over(keep, num_blocks))
        return super().collective_rpc(method, timeout, args, kwargs)

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Future:
        for req_id in scheduler_output.finished_req_ids:
            self.tables.pop(req_id, None)
        positions: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            positions[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                self.tables[req_id] += cached.new_block_ids[i][0]
            positions[req_id] = cached.num_computed_tokens[i]
        cache = self.worker.model_runner.extensible_kv_cache
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            start = positions[req_id]
            blocks = sorted({self.tables[req_id][p // sched.BLOCK_SIZE] for p in range(start, start + count)})
            for block in blocks:
                for offset in cache.segment_offsets:
                    addr = cache.buffer.base_ptr + offset + block * ext.PAGE
                    self.device.write(addr, ext.PAGE, WRITTEN, f"step writing block {block} of request {req_id}")
                self.written.append((req_id, block))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        for req_id in req_ids:
            self.sampled[req_id] += 1
        tokens = [
            [sched.EOS_TOKEN_ID if self.sampled[r] == self.eos_at.get(r) else sched.SAMPLED_TOKEN_ID] for r in req_ids
        ]
        self._output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens)
        done: Future = Future()
        # Nothing scheduled: vLLM's runner answers at once; else sample_tokens does.
        done.set_result(None if scheduler_output.total_num_scheduled_tokens else self._output)
        return done

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Future:
        return _DeviceFuture(self.device, self.device.record(), self._output)

    def _queued_over(self, keep: int, num_blocks: int) -> list[tuple[str, int]]:
        cache = self.worker.model_runner.extensible_kv_cache
        found = []
        for work in self.device.pending:
            addr = work.ranges[0][0] - cache.buffer.base_ptr
            for offset in cache.segment_offsets:
                block = (addr - offset) // ext.PAGE
                if addr >= offset and keep <= block < num_blocks:
                    found.append((work.name, block))
        return found


@pytest.fixture
def async_engine(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> EngineCore:
    """``ext._engine``'s engine core with vLLM's async scheduler and batch
    queue (two steps in flight), as ``--async-scheduling`` runs it."""
    monkeypatch.setattr(sched, "NUM_BLOCKS", ext.NUM_BLOCKS)
    monkeypatch.setattr(sched, "Scheduler", AsyncScheduler)
    core = ext._engine(tiny_model)
    assert isinstance(core.scheduler, AsyncScheduler)
    core.model_executor = _AsyncWorkers(core.model_executor.worker, driver.device)  # type: ignore[attr-defined]
    core.batch_queue_size = 2
    core.batch_queue = collections.deque(maxlen=2)
    core.is_mm_encoder_only = core.is_pooling_model = core.check_for_draft_tokens = False
    yield core
    if driver.device.fault is None:  # type: ignore[attr-defined]  # else the device is lost; the driver frees it all
        ext._cache(core).free()


@pytest.mark.parametrize("mode", ["drain", "preempt"])
def test_a_release_lets_the_step_in_flight_write_first(
    async_engine: EngineCore, driver: HostVmmDriver, mode: str
) -> None:
    """Drain: the request above the limit stops (EOS) while the engine has
    already queued its next step; the release after that step comes with
    the step in flight. Preempt: the limit preempts it at once, while its
    prefill is in flight, and releases in the same call."""
    core = async_engine
    workers = core.model_executor
    pool = core.scheduler.kv_cache_manager.block_pool
    held = pool.get_new_blocks(300)  # blocks 1-300: the request gets 301-303, in the chunk above 256
    sched._add(core, ["0"], max_tokens=12)
    workers.eos_at["0"] = 3  # it stops on its third token: the scheduler has already scheduled a fourth
    core.step_with_batch_queue()  # its prefill, queued on the device
    assert sched._blocks(core) == {"0": [301, 302, 303]}
    pool.free_blocks(held)
    status = core.kv_cache_limit_set(ext.LIMIT * ext.BYTES_PER_BLOCK, mode)
    assert not limit_math.is_error(status), status

    for _ in range(20):
        core.step_with_batch_queue()
        if not core.scheduler.has_requests() and not core.batch_queue:
            break
    assert not core.scheduler.has_requests() and not core.batch_queue

    # The premise: the release came while a step writing the request's
    # blocks above the limit was still queued on the device.
    assert len(workers.in_flight_at_release) == 1, workers.in_flight_at_release
    assert {b for _, b in workers.in_flight_at_release[0]} & {301, 302, 303}, workers.in_flight_at_release
    assert driver.mapped_bytes == ext._chunked(ext.LIMIT)  # the chunks above 256 went
    driver.device.synchronize()  # type: ignore[attr-defined]  # no fault: the writes ran before they went
    assert driver.device.fault is None  # type: ignore[attr-defined]
