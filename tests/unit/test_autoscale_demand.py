"""The autoscaler's demand between decisions (``hooks.runtime.demand``):
with thousands of waiting requests the whole demand is read once per tick,
not at every step; between ticks only the requests that arrived are looked
at, and a grow they call for is still decided at once. Stand-in scheduler
and requests with vLLM's attribute names (``requests`` in arrival order);
each request counts how often its tokens are read. The real scheduler:
``tests/cuda_wheel/test_demand_scheduler.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.unit.test_autoscaling import BLOCK_SIZE, BPB, Engine, new_autoscaler, tick  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime import autoscaler  # noqa: E402
from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy  # noqa: E402


class Counted:
    """A request of ``blocks`` blocks (``max_tokens`` 1) that counts the reads of its tokens."""

    visits = 0

    def __init__(self, blocks: int) -> None:
        self.num_prompt_tokens = blocks * BLOCK_SIZE - 1
        self.max_tokens = 1

    @property
    def num_tokens(self) -> int:
        Counted.visits += 1
        return self.num_prompt_tokens


@pytest.fixture(autouse=True)
def _visits() -> None:
    Counted.visits = 0


def test_ten_thousand_waiting_requests_are_visited_up_to_the_ceiling_once_per_tick_and_arrivals_once() -> None:
    """10,000 waiting requests of one block, a ceiling of 100: 40 steps of
    10 ms, two requests arriving after each. Each tick visits requests until
    their blocks reach the ceiling (every decision is the same above it);
    between ticks only the arrivals are visited, each once."""
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.ceiling = 100
    engine.requests = {str(i): Counted(1) for i in range(10_000)}
    tick(engine, scaler, 100.0)
    assert engine.limit == 100 and scaler.demand == 100  # the premise: far above what the limit can grow to
    Counted.visits = 0
    reads = 0
    for step in range(1, 41):
        now = 100.0 + step / 100
        due = now - scaler.last_tick >= autoscaler.TICK_S
        before = Counted.visits
        tick(engine, scaler, now)
        reads += due
        visited = Counted.visits - before
        assert visited == (scaler.ceiling if due else 0), (step, visited)
        for k in range(2):
            engine.requests[f"new-{step}-{k}"] = Counted(1)
    assert 3 <= reads <= 4 and scaler.demand == 100  # once per 0.1 s


@pytest.mark.parametrize("seed", range(20))
def test_a_demand_counted_up_to_the_ceiling_decides_as_the_whole_demand(seed: int) -> None:
    """Why the reading may stop at the ceiling: two hystereses, one given
    the whole demand and one the demand capped at the ceiling, make the same
    decisions, wishes and needs through random demands, limits and times."""
    import random

    rng = random.Random(seed)
    ceiling = rng.randint(8, 64)
    policy = Policy(
        floor=rng.randint(1, 6), blocks_per_request=rng.randint(1, 40), shrink_after_s=rng.choice([0.0, 0.5, 3.0])
    )
    whole, capped = Hysteresis(policy), Hysteresis(policy)
    now, limit = 0.0, ceiling
    for _ in range(300):
        now += rng.choice([0.01, 0.1, 0.4, 2.0])
        demand = rng.choice([0, rng.randint(0, ceiling), rng.randint(ceiling, 10 * ceiling)])
        decided = whole.decide(now, demand, limit, ceiling)
        assert capped.decide(now, min(demand, ceiling), limit, ceiling) == decided, (now, demand, limit)
        assert (capped.target, capped.wish, capped.need) == (whole.target, whole.wish, whole.need)
        limit = decided if decided is not None else rng.choice([limit, rng.randint(policy.floor, ceiling + 4)])


def test_arrivals_that_need_more_blocks_than_the_limit_grow_it_at_once() -> None:
    """Below the ceiling, requests that arrive 10 ms after a decision and
    need more blocks than the limit grow it in that step, from a read of the
    whole demand; the steps before, with arrivals that fit, read nothing but
    the arrivals."""
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    engine.set_limit(engine, 20 * BPB, "drain")
    engine.requests = {str(i): Counted(1) for i in range(10)}
    tick(engine, scaler, 100.0)
    assert engine.limit == 20
    Counted.visits = 0
    engine.requests["a"] = Counted(2)  # 12 blocks: fits
    tick(engine, scaler, 100.01)
    assert engine.limit == 20 and Counted.visits == 1
    engine.requests["b"] = Counted(8)  # 20 blocks and the null block: more than the limit
    tick(engine, scaler, 100.02)
    assert engine.limit == 20 + 8 + 1, engine.calls  # the demand, one request of headroom, the null block
    assert Counted.visits == 1 + 1 + len(engine.requests)


def test_finished_requests_do_not_make_arrivals_grow_the_limit() -> None:
    """Requests that finished since the last read still count in the
    arrivals' estimate: it rises above the limit, the whole demand is read
    and shows no rise, nothing is decided, and arrivals wait for the tick;
    a request whose id came back (another object) counts as an arrival."""
    engine = Engine()
    scaler = new_autoscaler(engine, None)
    scaler.hysteresis = Hysteresis(Policy(20, 8, shrink_after_s=1000.0))
    engine.set_limit(engine, 20 * BPB, "drain")
    engine.requests = {str(i): Counted(1) for i in range(15)}
    tick(engine, scaler, 100.0)
    for i in range(10):
        del engine.requests[str(i)]  # finished
    engine.requests["0"] = Counted(8)  # 5 + 8 = 13 blocks; the estimate says 15 + 8
    tick(engine, scaler, 100.01)
    assert engine.limit == 20 and scaler.demand == 15
    engine.requests["1"] = Counted(8)  # 21 blocks: more than the limit, decided at the tick
    Counted.visits = 0
    tick(engine, scaler, 100.02)
    assert engine.limit == 20 and Counted.visits == 0
    tick(engine, scaler, 100.11)
    assert engine.limit == 21 + 8 + 1 and scaler.demand == 21, engine.calls
