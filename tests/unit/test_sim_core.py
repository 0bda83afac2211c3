"""vllm-kv-sim's discrete-event core: vLLM's real scheduler stepped by the
simulator's executor on a virtual clock, timed by a linear step-time model.

Real: vLLM's ``EngineCore.step``, ``Scheduler``, ``KVCacheManager`` and
``BlockPool`` (vLLM's CPU build), the plugin's run-time limit, autoscaler
and ledger (a private lock folder). Modelled: the step time (linear) and
the model's tokens (one sampled token per decode or finished prefill).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit.sim import scenarios, traffic  # noqa: E402
from vllm_kv_cache_limit.sim.device import Device  # noqa: E402
from vllm_kv_cache_limit.sim.instance import InstanceSpec  # noqa: E402
from vllm_kv_cache_limit.sim.step_time import LinearStepTime  # noqa: E402
from vllm_kv_cache_limit.sim.traffic import Arrival  # noqa: E402

A, B, C = 0.01, 0.001, 0.0001
"""The step time: 10 ms a step, 1 ms a decoding request, 0.1 ms a prompt token."""
LINEAR = LinearStepTime(A, B, C)
MAX_MODEL_LEN = 512
BLOCK = 16


def _setup(model: str, traffic_: list[list[Arrival]], budget_blocks: int, **kwargs: Any) -> scenarios.Setup:
    """Instances of the tiny Llama sharing ``budget_blocks`` blocks (of its KV cache shape, as vLLM reads it)."""
    specs = [InstanceSpec(f"i{n}", model, MAX_MODEL_LEN, BLOCK) for n in range(len(traffic_))]
    from vllm_kv_cache_limit.sim.clock import VirtualClock
    from vllm_kv_cache_limit.sim.instance import SimExecutor, build_engine_core

    probe = SimExecutor(VirtualClock(), LINEAR)
    build_engine_core(specs[0], 1 << 24, probe)
    return scenarios.Setup(specs, traffic_, [LINEAR] * len(specs), budget_blocks * probe.bytes_per_block, **kwargs)


def test_one_instance_times_match_a_hand_computation(tiny_model: str) -> None:
    """Each step takes A + B * decodes + C * prompt tokens on the virtual clock:
    request 1 (100 prompt tokens, 3 out) prefills in 0.02 s and decodes in
    0.011 s a step; request 2 (200, 2) arrives at 1 s; requests 3 and 4 (50, 2
    each) arrive together at 2 s and are prefilled in one step, decoded in one."""
    arrivals = [Arrival(0.0, 100, 3), Arrival(1.0, 200, 2), Arrival(2.0, 50, 2), Arrival(2.0, 50, 2)]
    result = scenarios.run("even", _setup(tiny_model, [arrivals], 256))
    records = result["records"]["i0"]
    expected = [
        # arrival, first token, finished
        (0.0, A + C * 100, A + C * 100 + 2 * (A + B)),
        (1.0, 1.0 + A + C * 200, 1.0 + A + C * 200 + (A + B)),
        (2.0, 2.0 + A + C * 100, 2.0 + A + C * 100 + (A + 2 * B)),
        (2.0, 2.0 + A + C * 100, 2.0 + A + C * 100 + (A + 2 * B)),
    ]
    got = [(r.arrival, r.first_token, r.finished) for r in records]
    assert [value for row in got for value in row] == pytest.approx([v for row in expected for v in row], abs=1e-9)
    assert [r.tokens for r in records] == [3, 2, 2, 2]
    figures = result["instances"]["i0"]
    assert figures["ttft_s"]["p50"] == pytest.approx(A + C * 100, abs=1e-9)
    assert figures["output_tokens"] == 9 and figures["preemptions"] == 0
    # The device was busy exactly for the steps: 3 + 2 + 2 steps of the times above.
    busy = (A + C * 100 + 2 * (A + B)) + (A + C * 200 + A + B) + (A + C * 100 + A + 2 * B)
    assert result["instances"]["i0"]["busy_s"] == pytest.approx(busy, abs=1e-9)


def test_no_step_reads_the_wall_clock(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the device runs, every wall-clock reading and sleep raises; the
    autoscaled run still completes, its limits changed (vLLM's scheduler and
    the plugin's limit and autoscaler read the time at each step and change)."""
    real_run = Device.run
    readings = ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns", "sleep")
    ran: list[float] = []

    def wall(*args: Any) -> float:
        raise AssertionError("the simulation read the wall clock or slept")

    def guarded(self: Device) -> None:
        with pytest.MonkeyPatch.context() as patch:
            for name in readings:
                patch.setattr(time, name, wall)
            real_run(self)
        ran.append(self.clock.now)

    monkeypatch.setattr(Device, "run", guarded)
    burst = traffic.gamma(20.0, 3.0, 5.0, 200, 30, seed=1)
    result = scenarios.run("autoscale", _setup(tiny_model, [burst], 400, shrink_after_s=1.0))
    figures = result["instances"]["i0"]
    assert ran and ran[0] > 5.0  # the premise: the guarded run is the one that ran, past the last arrival
    assert figures["finished"] == figures["requests"] == len(burst) > 50
    assert figures["limit_changes"] >= 2  # grew for the burst and shrank after it, each change stamped


def test_the_shared_budget_moves_between_instances(tiny_model: str) -> None:
    """Two autoscaled instances under one budget of 200 blocks: a burst on
    the first, then, once it has drained and idled past the hysteresis, one
    on the second. The first grows above the even share (100) while the
    second holds its floor, gives it back, and the second grows above it
    (the real autoscaler and ledger moved the budget); the static even
    split never goes above its 100 blocks, and serves the burst slower."""
    first = [Arrival(0.5 + i * 0.01, 400, 40) for i in range(40)]
    second = [Arrival(20.0 + i * 0.01, 400, 40) for i in range(40)]
    setup = _setup(tiny_model, [first, second], 200, shrink_after_s=2.0)
    shared = scenarios.run("autoscale", setup)
    even = scenarios.run("even", setup)
    points = shared["limits"]
    floor = min(limits[1] for _, limits in points)
    assert len(points) > 100 and floor < 100
    grew_first = [t for t, (a, b) in points if a > 100 and b == floor]
    grew_second = [t for t, (a, b) in points if b > 100 and a == floor]
    assert grew_first and grew_second and max(grew_first) < min(grew_second) < 20.5, points[::20]
    assert shared["instances"]["i0"]["limit_changes"] >= 2 and shared["instances"]["i1"]["limit_changes"] >= 1
    # At every instant sampled, the two limits together stay within the budget.
    assert all(sum(limits) <= 200 for _, limits in points), points
    assert max(max(limits) for _, limits in even["limits"]) == 100
    for name in ("i0", "i1"):
        assert shared["instances"][name]["e2e_s"]["p90"] < even["instances"][name]["e2e_s"]["p90"]


def test_timeline_sums_the_waiting_blocks_only_for_the_plot(tiny_model: str) -> None:
    """A burst that queues on a small budget: with ``waiting_blocks`` (what
    ``--plot`` sets) each timeline point carries the blocks the waiting
    prompts need, ceil(400 / 16) = 25 a request; without it that walk of
    the queue is skipped (None) and the rest of the timeline is the same."""
    burst = [Arrival(0.5 + i * 0.01, 400, 40) for i in range(40)]
    plotted = scenarios.run("even", _setup(tiny_model, [burst], 100, waiting_blocks=True))["timelines"]["i0"]
    plain = scenarios.run("even", _setup(tiny_model, [burst], 100))["timelines"]["i0"]
    queued = [point for point in plotted if point[3] > 1]
    assert queued, "the premise: requests waited"
    assert all(point[4] == 25 * point[3] for point in queued), queued[:5]
    assert all(point[4] is None for point in plain)
    assert [point[:4] for point in plain] == [point[:4] for point in plotted]


def test_arrivals_grow_the_limit_before_the_next_step_schedules_them(tiny_model: str) -> None:
    """Four requests of 400 prompt tokens (25 blocks each) reach an idle
    autoscaled instance at its floor (one request of ``max_model_len``)
    together. A real engine core decides after each request reaches it (the
    plugin's input-queue hook), so its limit grows before its next step, and
    that step prefills all four: their first tokens at 1 s + A + C * 1600."""
    arrivals = [Arrival(1.0, 400, 2) for _ in range(4)]
    result = scenarios.run("autoscale", _setup(tiny_model, [arrivals], 400))
    floor = min(limits[0] for _, limits in result["limits"])
    assert floor < 4 * 400 // BLOCK  # the premise: the floor holds fewer than the four
    firsts = [r.first_token for r in result["records"]["i0"]]
    assert firsts == pytest.approx([1.0 + A + C * 1600] * 4, abs=1e-9)
