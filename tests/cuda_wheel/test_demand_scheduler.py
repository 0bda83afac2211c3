"""The autoscaler's demand on vLLM's real scheduler with many requests: read
once per decision (every ``TICK_S``, or at once when arrivals raise it above
a limit that can grow), not at every step, and its decisions the same as
those of a demand read at every step.

Real and faked as in ``test_resize_scheduler`` (whose engine core, requests
and executor these tests use): vLLM's ``Scheduler`` and ``EngineCore.step``
as the plugin wraps it, the plugin's ``start_autoscaling``; the workers and
the device faked. The autoscaler's clock is the test's (``autoscaler.time``),
one step ``STEP_S`` long, so that which steps a tick is due in does not
depend on how fast this machine runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.engine.core import EngineCore

from tests.cuda_wheel.conftest import FakeGPU
from tests.cuda_wheel.test_resize_scheduler import _add, _demand, _engine_core, _limit, _scheduler
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy

STEP_S = 0.03
"""One step of the model, as the autoscaler's clock sees it."""
SHRINK_AFTER_S = 0.2


class _Clock:
    """``time`` as the autoscaler's module reads it: moved by the test only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(autoscaler, "time", clock)
    return clock


@pytest.fixture
def autoscaled_cores(fake_gpu: FakeGPU, tiny_model: str) -> Iterator[Callable[[], EngineCore]]:
    """Engine cores started with ``--kv-cache-autoscale`` (no shared budget),
    their in-process timers stopped so that only the test's steps decide,
    and a hysteresis of ``SHRINK_AFTER_S``."""
    scalers: list[Autoscaler] = []

    def start() -> EngineCore:
        core = _engine_core(_scheduler(tiny_model))
        cache_config = core.vllm_config.cache_config
        setattr(cache_config, autoscaler.AUTOSCALE, True)
        setattr(cache_config, autoscaler.MIN_MEMORY, None)
        setattr(cache_config, autoscaler.SHARED_BUDGET, None)
        start_autoscaling(core)
        scaler = _scaler(core)
        scalers.append(scaler)
        scaler.stop.set()
        assert scaler.timer is not None
        scaler.timer.join(timeout=5)
        policy = scaler.hysteresis.policy
        scaler.hysteresis = Hysteresis(Policy(policy.floor, policy.blocks_per_request, SHRINK_AFTER_S))
        return core

    yield start
    for scaler in scalers:
        scaler.close()


def _scaler(core: EngineCore) -> Autoscaler:
    scaler = EngineCoreState.of(core).autoscaler
    assert isinstance(scaler, Autoscaler)
    return scaler


def _count_reads(scaler: Autoscaler) -> list[int]:
    """Each whole read of the demand, as the number of requests it covered."""
    reads: list[int] = []
    read_demand = scaler.read_demand

    def counted(scheduler: Any) -> int:
        reads.append(len(scheduler.requests))
        return read_demand(scheduler)

    scaler.read_demand = counted  # type: ignore[method-assign]
    return reads


def test_ten_thousand_waiting_requests_are_read_once_per_tick_not_per_step(
    autoscaled_cores: Callable[[], EngineCore], clock: _Clock
) -> None:
    """An overloaded engine core: 10,000 requests wait, more arrive at every
    step, the demand is far above the allocation (the limit's ceiling). Over
    40 steps of 10 ms the whole demand is read at most once per 0.1 s tick,
    not at each step."""
    core = autoscaled_cores()
    scheduler = core.scheduler
    scaler = _scaler(core)
    _add(core, [str(i) for i in range(10_000)])
    core.step()
    # 30,000 blocks (3 each), counted up to the ceiling: every decision is the same above it.
    assert _limit(core).limit == scaler.ceiling and scaler.demand == scaler.ceiling
    reads = _count_reads(scaler)
    steps, step_s = 40, 0.01
    for step in range(steps):
        clock.now += step_s
        core.step()
        _add(core, [str(10_000 + 2 * step + k) for k in range(2)])  # two more arrive after each step
    assert scheduler.get_request_counts()[1] > 9_900
    ticks = round(steps * step_s / autoscaler.TICK_S)
    assert len(reads) <= ticks + 1, f"the demand was read {len(reads)} times in {steps} steps ({ticks} ticks)"
    assert min(reads) > 9_900  # each read is of a scheduler with every request unfinished


def _reading_every_step(scaler: Autoscaler) -> None:
    """The autoscaler's rule with the demand read at every step (the
    reference): a decision once ``TICK_S`` has passed since the last, or at
    once when the demand rose above the limit since it."""

    def tick(engine_core: Any, pool_limit: Any, now: float | None = None) -> None:
        now = autoscaler.time.monotonic() if now is None else now
        demand = sum(_demand(r) for r in engine_core.scheduler.requests.values())
        rose = demand > scaler.demand and demand + limit_math.NULL_BLOCKS > pool_limit.limit
        if now - scaler.last_tick < autoscaler.TICK_S and not rose:
            return
        scaler.last_tick = now
        scaler._tick(engine_core, pool_limit, now, demand)

    scaler.tick = tick  # type: ignore[method-assign]


def _limits_over_a_run(core: EngineCore, clock: _Clock) -> list[int]:
    """The limit after each step of a run with arrivals, aborts, a demand
    above the allocation and an idle end: requests of 3 blocks (and of 8,
    ``max_tokens`` 1000) arrive in the steps listed, two are aborted while
    others arrive."""
    arrivals: dict[int, list[tuple[str, int]]] = {
        0: [("0", 4), ("1", 4)],
        1: [("2", 4), ("3", 4), ("4", 4)],
        2: [("5", 4)],
        4: [("6", 1000), ("7", 1000), ("8", 1000), ("9", 1000), ("10", 1000)],
        5: [("11", 4)],
        7: [("12", 4), ("13", 4)],
        9: [("14", 4)],
    }
    limits = []
    for step in range(40):
        for req_id, max_tokens in arrivals.get(step, []):
            _add(core, [req_id], max_tokens=max_tokens)
        if step == 7:
            core.abort_requests(["6", "7"])
        if step == 12:
            core.abort_requests(["8", "9", "10"])
        core.step()
        limits.append(_limit(core).limit)
        clock.now += STEP_S
    assert not core.scheduler.has_requests()
    return limits


def test_the_decisions_are_those_of_a_demand_read_at_every_step(
    autoscaled_cores: Callable[[], EngineCore], clock: _Clock
) -> None:
    """The same run of requests on two engine cores, one with the
    autoscaler as the plugin runs it, one reading the whole demand at every
    step: the same limit after every step. The run grows the limit at once
    (in a step 30 ms after the last decision), up to the allocation, and
    shrinks it after the hysteresis once the requests have gone."""
    reference = autoscaled_cores()
    _reading_every_step(_scaler(reference))
    expected = _limits_over_a_run(reference, clock)
    floor = _scaler(reference).floor
    assert expected[0] == floor and expected[1] > floor, expected  # a grow at once, not at the next tick
    assert max(expected) == _limit(reference).allocation.num_blocks and expected[-1] == floor, expected

    clock.now = 1000.0
    plugin = autoscaled_cores()
    reads = _count_reads(_scaler(plugin))
    assert _limits_over_a_run(plugin, clock) == expected
    assert len(reads) < 40
