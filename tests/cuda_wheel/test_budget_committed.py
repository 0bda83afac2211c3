"""The shared budget's ledger never says less than the GPU memory the
autoscaled caches have committed (issue 49, item 5), checked at every
instant: after each call that commits or returns memory on the device (the
VMM stand-in's ``cuMemCreate``, ``cuMemMap``, ``cuMemUnmap``,
``cuMemRelease``) and after each write of a ledger entry, from the start
of each instance's start-up (vLLM commits its whole allocation before the
plugin can lower it: the entry reserves it first), through a grow, a
give-back drained under requests, a release the device fails and its
retry, and shutdown. vLLM's own extensible KV cache, block pool, scheduler
and ``EngineCore.step`` run through the plugin, as in
``test_extensible_resize``; only the driver is the stand-in.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.engine.core import EngineCore

from tests.cuda_wheel import test_extensible_resize as resize
from tests.cuda_wheel import test_resize_scheduler as sched
from tests.cuda_wheel.conftest import FakeGPU
from tests.cuda_wheel.vmm_standin import HostVmmDriver, VmmRuleError
from vllm_kv_cache_limit.hooks.cap.engine_core import _hold_startup_lock
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.limit import RuntimeLimit
from vllm_kv_cache_limit.logic import budget_ledger, envs

BPB = resize.BYTES_PER_BLOCK
CHUNK = resize.BLOCKS_PER_CHUNK
BUDGET = resize.BUDGET_BLOCKS * BPB


class Invariant:
    """Compares the ledger's holds (every live entry file of the folder)
    with the bytes the device has committed, after each event."""

    def __init__(self, folder: Path, driver: HostVmmDriver) -> None:
        self.folder, self.driver = folder, driver
        self.phase = "start-up"
        self.broken: list[str] = []
        self.checks = 0

    def ledger(self) -> int:
        total = 0
        for entry in self.folder.glob("budget-*/*.entry"):
            try:
                total += int(json.loads(entry.read_text())["holds"])
            except (OSError, ValueError, KeyError):
                continue  # created, not yet written: holds nothing yet
        return total

    def check(self, event: str) -> None:
        self.checks += 1
        ledger, committed = self.ledger(), self.driver.physical_bytes
        if ledger < committed:
            self.broken.append(
                f"{self.phase}, after {event}: ledger {ledger // BPB} blocks < committed {committed // BPB} blocks"
            )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("create", "map", "unmap", "release"):
            original = getattr(self.driver, name)

            def call(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.check(f"cuMem{_name.capitalize()}")

            monkeypatch.setattr(self.driver, name, call)
        write = budget_ledger._write

        def write_checked(fd: int, record: dict[str, Any]) -> None:
            write(fd, record)
            self.check("a ledger write")

        monkeypatch.setattr(budget_ledger, "_write", write_checked)

    def assert_held(self) -> None:
        assert self.checks, "the premise: events were checked"
        assert not self.broken, "\n".join(self.broken)


def _autoscaled(tiny_model: str, invariant: Invariant, monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    """An autoscaled engine under the shared budget, started as the plugin
    starts one: the plugin's wrapper of ``EngineCore.__init__``
    (``_hold_startup_lock``) around what vLLM's ``__init__`` does to the KV
    cache (its extensible KV cache allocated and extended to the whole
    reservation by vLLM's own code: ``resize._engine``), then the start of
    autoscaling it runs before the start-up lock is released. Checked at
    every event, vLLM's allocation included."""
    scheduler = sched._scheduler(tiny_model)
    vllm_config = scheduler.vllm_config
    cache_config = vllm_config.cache_config
    cache_config.kv_cache_max_memory = resize.NUM_BLOCKS * BPB  # the cap, as the plugin's argument sets it
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, None)
    setattr(cache_config, autoscaler.SHARED_BUDGET, BUDGET)
    invariant.phase = "start-up"

    def vllm_init(self: EngineCore, config: Any) -> None:
        assert config is vllm_config
        with monkeypatch.context() as patched:
            patched.setattr(sched, "_scheduler", lambda model, prefix_caching=False: scheduler)
            self.__dict__.update(resize._engine(tiny_model).__dict__)

    core = object.__new__(EngineCore)
    _hold_startup_lock(vllm_init)(core, vllm_config)
    assert invariant.driver.physical_bytes > 0, "the premise: vLLM committed the cache"
    scaler = resize._scaler(core)
    scaler.stop.set()
    if scaler.timer is not None:
        scaler.timer.join(timeout=5)
    return core


def _decide(core: EngineCore, at: float) -> None:
    """What the engine core does between steps at monotonic time ``at``
    (``engine_core._between_steps``): a release due, the autoscaling
    decision, a release due."""
    limit = _limit(core)
    limit.release_if_due(at)
    resize._scaler(core).tick(core, limit, now=at)
    limit.release_if_due(at)


def _limit(core: EngineCore) -> RuntimeLimit:
    limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool)
    assert limit is not None
    return limit


def test_the_ledger_holds_at_least_what_the_device_commits_at_every_step(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sched, "NUM_BLOCKS", resize.NUM_BLOCKS)
    monkeypatch.setenv(envs.LOCK_DIR, str(tmp_path))
    monkeypatch.setenv(envs.SHRINK_AFTER_S, "0")
    invariant = Invariant(tmp_path, driver)
    invariant.install(monkeypatch)
    first = second = None
    try:
        first = _autoscaled(tiny_model, invariant, monkeypatch)
        second = _autoscaled(tiny_model, invariant, monkeypatch)
        floor = resize._scaler(first).floor
        assert floor == CHUNK and driver.physical_bytes == 2 * floor * BPB  # the premise: both at their floor
        now = time.monotonic()

        invariant.phase = "a grow"
        sched._add(first, [str(i) for i in range(20)], max_tokens=1000)
        first.step()
        _decide(first, now + 1)
        assert _limit(first).limit == 2 * CHUNK  # the premise: it grew into the budget
        assert driver.physical_bytes == BUDGET

        invariant.phase = "a give-back drained under requests"
        pool = first.scheduler.kv_cache_manager.block_pool
        taken = pool.get_new_blocks(200)  # requests holding blocks up to 200
        assert max(block.block_id for block in taken) >= floor
        sched._add(second, [str(i) for i in range(20)], max_tokens=1000)
        second.step()
        _decide(second, now + 2)  # wants more: the budget is full
        _decide(first, now + 3)  # gives back while its requests still hold blocks above
        assert _limit(first).limit == floor and driver.physical_bytes == BUDGET  # the premise: not drained yet

        invariant.phase = "a release the device fails"
        real_unmap = driver.unmap
        failed: list[int] = []
        faulty = [True]

        def unmap_failing(ptr: int, size: int) -> None:
            if faulty[0]:
                failed.append(ptr)
                raise VmmRuleError(700, "cuMemUnmap", "an illegal address was encountered")
            real_unmap(ptr, size)

        monkeypatch.setattr(driver, "unmap", unmap_failing)
        pool.free_blocks(taken)
        first.abort_requests([str(i) for i in range(20)])  # drained
        _decide(first, now + 4)  # the release fails
        assert failed, "the premise: the release was tried and failed"
        _decide(first, now + 4.2)
        _decide(second, now + 4.5)  # must not grow into memory still committed
        assert driver.physical_bytes <= BUDGET
        assert _limit(second).limit == floor

        invariant.phase = "the release retried"
        faulty[0] = False
        for step in range(1, 200):  # the retry comes at a later decision
            _decide(first, now + 5 + step)
            if driver.physical_bytes < BUDGET:
                break
        assert driver.physical_bytes == BUDGET - CHUNK * BPB  # the premise: the retry returned the chunk
        _decide(first, now + 300)
        _decide(second, now + 301)
        assert _limit(second).limit == 2 * CHUNK  # it grows once the memory is back
        assert driver.physical_bytes == BUDGET

        invariant.phase = "shutdown"
        for core in (first, second):
            core.model_executor.shutdown = resize._cache(core).free  # the workers' exit frees their memory
            core.structured_output_manager = type("Manager", (), {"clear_backend": lambda self: None})()
            core.shutdown()
        first = second = None
        assert driver.physical_bytes == 0 and invariant.ledger() == 0
    finally:
        for core in (first, second):
            if core is not None:
                resize._scaler(core).close()
                resize._cache(core).free()
    invariant.assert_held()
