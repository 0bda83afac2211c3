"""The autoscaler's decisions as pure functions (``autoscale``): the target,
the hysteresis of ``Hysteresis.decide``, the split of a shared budget, and the
settings refused before anything loads."""

from __future__ import annotations

import math
import random

import pytest

from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.autoscale_policy import (
    DEFAULT_SHRINK_AFTER_S,
    WISH_HOLD_S,
    Hysteresis,
    Policy,
    Share,
    check_executor,
    check_settings,
    device_bytes_per_block,
    entitlement,
    fits_floors,
    give_back,
    grant,
    lazy_release,
    must_reclaim,
    release_lazily,
    shrink_after_s,
)
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.limit_math import NULL_BLOCKS, Allocation

GiB = 2**30
MiB = 2**20
POLICY = Policy(floor=20, blocks_per_request=8, shrink_after_s=30.0)
CEILING = 1000


def expected_target(demand: int, policy: Policy = POLICY, ceiling: int = CEILING) -> int:
    """The documented rule, written out independently: demand plus a quarter
    of it (rounded up), at least one request, plus the null block, within
    [floor, ceiling]."""
    headroom = max(policy.blocks_per_request, math.ceil(demand / 4))
    return max(policy.floor, min(ceiling, demand + headroom + NULL_BLOCKS))


# --- Policy.target ---------------------------------------------------------------


@pytest.mark.parametrize("demand", [0, 1, 10, 31, 32, 33, 100, 101, 797, 798, 799, 5000])
def test_target_is_demand_plus_headroom_within_floor_and_ceiling(demand: int) -> None:
    assert POLICY.target(demand, CEILING) == expected_target(demand)


def test_target_examples() -> None:
    # A quarter of 100 (25) is more than one request (8): 100 + 25 + the null block.
    assert POLICY.target(100, CEILING) == 126
    # A quarter of 101 is 25.25, rounded up to 26.
    assert POLICY.target(101, CEILING) == 128
    # A quarter of 12 (3) is less than one request (8): the request is the headroom.
    assert POLICY.target(12, CEILING) == 12 + 8 + 1
    # Little demand: the floor.
    assert POLICY.target(0, CEILING) == POLICY.floor
    # Much demand: the ceiling.
    assert POLICY.target(10_000, CEILING) == CEILING


# --- Hysteresis.decide: grow ----------------------------------------------------------


def test_grows_at_once_when_demand_exceeds_the_limit() -> None:
    scaler = Hysteresis(POLICY)
    # 100 blocks wanted, 50 under the limit: no waiting, straight to demand + headroom.
    assert scaler.decide(0.0, demand=100, limit=50, ceiling=CEILING) == 100 + 25 + NULL_BLOCKS
    assert scaler.below_since is None


def test_grows_when_the_null_block_leaves_one_short() -> None:
    # The null block is not usable: a demand equal to the limit does not fit.
    scaler = Hysteresis(POLICY)
    assert scaler.decide(0.0, demand=50, limit=50, ceiling=CEILING) == expected_target(50)


def test_grow_stops_at_the_ceiling() -> None:
    scaler = Hysteresis(POLICY)
    assert scaler.decide(0.0, demand=900, limit=100, ceiling=CEILING) == CEILING
    # Already at the ceiling: nothing more to give, the limit is kept.
    assert scaler.decide(1.0, demand=2000, limit=CEILING, ceiling=CEILING) is None


def test_keeps_a_limit_that_holds_demand_and_headroom() -> None:
    scaler = Hysteresis(POLICY)
    limit = expected_target(100)
    for now in (0.0, 10.0, 100.0, 1000.0):
        assert scaler.decide(now, demand=100, limit=limit, ceiling=CEILING) is None
    assert scaler.below_since is None


# --- Hysteresis.decide: shrink with hysteresis ----------------------------------------


def test_no_shrink_before_shrink_after_s_then_shrink_to_target() -> None:
    scaler = Hysteresis(POLICY)
    limit, demand = 500, 40
    assert expected_target(demand) < limit  # the premise: demand is low
    assert scaler.decide(100.0, demand, limit, CEILING) is None  # starts the wait
    assert scaler.below_since == 100.0
    for now in (101.0, 115.0, 129.0, 129.999):
        assert scaler.decide(now, demand, limit, CEILING) is None, now
    assert scaler.decide(130.0, demand, limit, CEILING) == expected_target(demand) == 40 + 10 + NULL_BLOCKS
    assert scaler.below_since is None


def test_shrink_never_goes_below_the_floor() -> None:
    policy = Policy(floor=64, blocks_per_request=8, shrink_after_s=5.0)
    scaler = Hysteresis(policy)
    assert scaler.decide(0.0, 0, 500, CEILING) is None
    assert scaler.decide(5.0, 0, 500, CEILING) == 64
    # At the floor with no demand: stays there.
    assert scaler.decide(6.0, 0, 64, CEILING) is None
    assert scaler.decide(100.0, 0, 64, CEILING) is None
    assert scaler.below_since is None


def test_shrink_goes_to_the_demand_at_the_end_of_the_wait() -> None:
    scaler = Hysteresis(POLICY)
    assert scaler.decide(0.0, 200, 500, CEILING) is None
    assert scaler.decide(15.0, 100, 500, CEILING) is None
    assert scaler.decide(30.0, 60, 500, CEILING) == expected_target(60)


@pytest.mark.parametrize(
    ("spike", "why"),
    [
        (400, "demand plus headroom reaches the limit, but fits under it"),
        (499, "demand uses every usable block"),
        (800, "requests wait for blocks: a grow"),
    ],
)
def test_a_spike_during_the_wait_resets_the_hysteresis(spike: int, why: str) -> None:
    scaler = Hysteresis(POLICY)
    limit, low = 500, 40
    assert scaler.decide(0.0, low, limit, CEILING) is None
    assert scaler.decide(20.0, low, limit, CEILING) is None
    spiked = scaler.decide(25.0, spike, limit, CEILING)
    assert spiked == (expected_target(spike) if spike + NULL_BLOCKS > limit else None), why
    assert scaler.below_since is None, why
    # 30 s after the first low tick, but only 5 s after the spike: no shrink.
    assert scaler.decide(30.0, low, limit, CEILING) is None, why
    assert scaler.below_since == 30.0
    assert scaler.decide(59.9, low, limit, CEILING) is None, why
    assert scaler.decide(60.0, low, limit, CEILING) == expected_target(low), why


def test_a_limit_above_the_ceiling_falls_to_it_at_once() -> None:
    scaler = Hysteresis(POLICY)
    scaler.below_since = 0.0  # a wait under way
    # Whatever the demand, and without waiting.
    assert scaler.decide(1.0, demand=10, limit=900, ceiling=300) == 300
    assert scaler.below_since is None
    assert scaler.decide(2.0, demand=5000, limit=900, ceiling=300) == 300
    assert scaler.decide(3.0, demand=200, limit=301, ceiling=300) == 300


def test_zero_hysteresis_shrinks_on_the_second_low_tick() -> None:
    scaler = Hysteresis(Policy(floor=10, blocks_per_request=4, shrink_after_s=0.0))
    assert scaler.decide(0.0, 10, 500, CEILING) is None
    assert scaler.decide(0.0, 10, 500, CEILING) == 10 + 4 + NULL_BLOCKS


def test_random_decisions_stay_within_floor_and_ceiling() -> None:
    """Whatever the sequence: a new limit is within [floor, ceiling]; a
    shrink only follows ``shrink_after_s`` of low demand; a grow only when
    the demand does not fit."""
    rng = random.Random(20240607)
    for _ in range(300):
        policy = Policy(
            floor=rng.randint(1, 100), blocks_per_request=rng.randint(1, 32), shrink_after_s=rng.choice([0.0, 1.0, 7.5])
        )
        ceiling = rng.randint(policy.floor, 2000)
        scaler = Hysteresis(policy)
        limit = rng.randint(policy.floor, ceiling)
        now, low_since = 0.0, None
        for _ in range(40):
            now += rng.choice([0.1, 0.5, 1.0, 3.0])
            demand = rng.randint(0, 2 * ceiling)
            target = policy.target(demand, ceiling)
            waits = demand + NULL_BLOCKS > limit
            low = not waits and target < limit
            new = scaler.decide(now, demand, limit, ceiling)
            if waits and target > limit:
                assert new == target  # a grow is never put off
            elif low and low_since is not None and now - low_since >= policy.shrink_after_s:
                assert new == target  # the wait is over: shrink
            else:
                assert new is None, (policy, ceiling, limit, demand, now, low_since)
            if new is not None:
                assert policy.floor <= new <= ceiling
                limit, low_since = new, None
            elif low:
                low_since = now if low_since is None else low_since
            else:
                low_since = None


# --- Hysteresis.wish: what the shared budget splits by --------------------------------


def test_the_wish_rises_with_the_target_at_once() -> None:
    scaler = Hysteresis(POLICY)
    scaler.decide(0.0, demand=10, limit=100, ceiling=CEILING)
    assert scaler.wish == expected_target(10)
    scaler.decide(0.1, demand=300, limit=100, ceiling=CEILING)
    assert scaler.wish == scaler.target == expected_target(300)


def test_the_wish_keeps_its_peak_while_demand_dips_then_falls_to_the_target() -> None:
    # A steady instance whose requests finish and arrive: its target dips
    # between them, its wish does not, until it has not been reached for WISH_HOLD_S.
    scaler = Hysteresis(POLICY)
    peak = expected_target(200)
    scaler.decide(0.0, demand=200, limit=peak, ceiling=CEILING)
    now = 0.0
    while now < WISH_HOLD_S - 0.1:
        now = round(now + 0.1, 1)
        scaler.decide(now, demand=0 if int(now * 10) % 2 else 40, limit=peak, ceiling=CEILING)
        assert scaler.wish == peak, now
    assert scaler.target < peak  # the premise: the target itself dipped
    scaler.decide(WISH_HOLD_S, demand=40, limit=peak, ceiling=CEILING)
    assert scaler.wish == expected_target(40)


def test_reaching_the_peak_again_renews_the_hold() -> None:
    scaler = Hysteresis(POLICY)
    peak = expected_target(200)
    again = WISH_HOLD_S * 0.8
    scaler.decide(0.0, demand=200, limit=peak, ceiling=CEILING)
    scaler.decide(again, demand=200, limit=peak, ceiling=CEILING)
    scaler.decide(WISH_HOLD_S * 1.2, demand=0, limit=peak, ceiling=CEILING)
    assert scaler.wish == peak  # reached again at 0.8 of the hold: held until 1.8 of it
    scaler.decide(again + WISH_HOLD_S, demand=0, limit=peak, ceiling=CEILING)
    assert scaler.wish == POLICY.floor


def test_the_wish_never_exceeds_a_lowered_ceiling() -> None:
    scaler = Hysteresis(POLICY)
    scaler.decide(0.0, demand=900, limit=100, ceiling=CEILING)
    assert scaler.wish == CEILING
    scaler.decide(0.1, demand=900, limit=CEILING, ceiling=300)
    assert scaler.wish == 300


# --- the shared budget -------------------------------------------------------------


def test_entitlement_is_the_wish_when_all_wishes_fit() -> None:
    me = Share(holds=10 * GiB, wants=3 * GiB, floor=GiB)
    others = [Share(holds=GiB, wants=4 * GiB, floor=GiB), Share(holds=GiB, wants=2 * GiB, floor=GiB)]
    assert entitlement(me, others, 9 * GiB) == 3 * GiB
    assert entitlement(me, others, 100 * GiB) == 3 * GiB


def test_entitlement_under_contention_is_max_min_fair() -> None:
    # Wishes 6 + 12 + 2 = 20 GiB for a 12 GiB budget (an even share: 4 GiB); floors 1 GiB each.
    a = Share(holds=0, wants=6 * GiB, floor=GiB)
    b = Share(holds=0, wants=12 * GiB, floor=GiB)
    c = Share(holds=0, wants=2 * GiB, floor=GiB)
    budget = 12 * GiB
    ent = {
        "a": entitlement(a, [b, c], budget),
        "b": entitlement(b, [a, c], budget),
        "c": entitlement(c, [a, b], budget),
    }
    # c wishes for less than an even share: all of it. a and b split the rest evenly, however
    # much more b wishes for than a (a deep queue does not buy a larger share).
    assert ent == {"a": 5 * GiB, "b": 5 * GiB, "c": 2 * GiB}
    assert sum(ent.values()) == budget


def test_entitlement_guarantees_the_wish_up_to_an_even_share() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        count = rng.randint(2, 5)
        shares = [random_share(rng, 10_000) for _ in range(count)]
        budget = rng.randint(sum(s.floor for s in shares), 12_000)
        even = budget // count
        for i, s in enumerate(shares):
            got = entitlement(s, shares[:i] + shares[i + 1 :], budget)
            if all(o.floor <= even for o in shares):
                assert got >= min(s.wants, even), (shares, budget, i, got)


def test_under_contention_the_needs_are_split_first_and_headroom_only_from_what_is_left() -> None:
    # A steady instance needs 13 blocks and wishes for 18 (its headroom); a
    # bursting one needs 400 and wishes for its ceiling, 32. Budget 32: the
    # steady one keeps what it needs, the bursting one gets the rest, not an
    # even 16 each.
    steady = Share(holds=0, wants=18, floor=5, needs=13)
    bursting = Share(holds=0, wants=32, floor=5, needs=32)
    assert entitlement(steady, [bursting], 32) == 13
    assert entitlement(bursting, [steady], 32) == 19
    # Both need more than an even share: an even share each.
    assert entitlement(Share(0, 32, 5, needs=20), [Share(0, 32, 5, needs=30)], 32) == 16
    # The needs fit with room to spare: the rest is split as headroom, up to each wish.
    calm = Share(holds=0, wants=12, floor=5, needs=6)
    busy = Share(holds=0, wants=32, floor=5, needs=20)
    assert entitlement(calm, [busy], 32) == 12
    assert entitlement(busy, [calm], 32) == 20
    assert entitlement(Share(0, 20, 5, needs=6), [busy], 32) == 12  # headroom split evenly: 6 each above 6 and 20


def test_an_entry_without_needs_is_split_by_its_wish() -> None:
    # An instance of an earlier release writes no needs: its wish is its need.
    old = Share(holds=0, wants=18, floor=5)
    new = Share(holds=0, wants=32, floor=5, needs=32)
    assert old.need == 18
    assert entitlement(old, [new], 32) == 16 == entitlement(new, [old], 32)


def test_the_needs_first_split_still_guarantees_each_need_up_to_an_even_share() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        count = rng.randint(2, 5)
        shares = []
        for _ in range(count):
            s = random_share(rng, 10_000)
            shares.append(Share(s.holds, s.wants, s.floor, needs=rng.randint(s.floor, s.wants)))
        budget = rng.randint(sum(s.floor for s in shares), 12_000)
        even = budget // count
        ents = [entitlement(s, shares[:i] + shares[i + 1 :], budget) for i, s in enumerate(shares)]
        if sum(s.wants for s in shares) > budget:
            assert sum(ents) <= budget
        for s, got in zip(shares, ents):
            assert s.floor <= got <= s.wants
            if all(o.floor <= even for o in shares):
                assert got >= min(s.need, even), (shares, budget, got)


def test_entitlement_keeps_each_floor() -> None:
    idle = Share(holds=4 * GiB, wants=2 * GiB, floor=2 * GiB)  # wants no more than its floor
    busy = Share(holds=4 * GiB, wants=40 * GiB, floor=GiB)
    assert entitlement(idle, [busy], 8 * GiB) == 2 * GiB
    assert entitlement(busy, [idle], 8 * GiB) == 8 * GiB - 2 * GiB
    # Floors that fill the budget: each gets its floor, nothing more.
    assert entitlement(busy, [idle], 3 * GiB) == GiB
    assert entitlement(idle, [busy], 3 * GiB) == 2 * GiB


def random_share(rng: random.Random, scale: int) -> Share:
    floor = rng.randint(0, scale // 4)
    wants = rng.randint(floor, scale)
    holds = rng.choice([0, floor, wants, rng.randint(0, scale)])
    return Share(holds=holds, wants=wants, floor=floor)


def test_entitlements_never_add_up_to_more_than_the_budget() -> None:
    rng = random.Random(7)
    checked = 0
    for _ in range(3000):
        shares = [random_share(rng, rng.choice([100, 10_000, 64 * GiB])) for _ in range(rng.randint(1, 6))]
        floors = sum(s.floor for s in shares)
        budget = rng.randint(floors, floors + sum(s.wants for s in shares))
        ents = [entitlement(s, shares[:i] + shares[i + 1 :], budget) for i, s in enumerate(shares)]
        for s, e in zip(shares, ents):
            assert s.floor <= e <= s.wants, (s, e, budget)
        if sum(s.wants for s in shares) > budget:
            assert sum(ents) <= budget, (shares, budget, ents)
            checked += 1
    assert checked > 1000  # the contended case was exercised


def test_grant_never_exceeds_the_budget_minus_the_others_holds() -> None:
    rng = random.Random(12345)
    within = 0
    for _ in range(5000):
        scale = rng.choice([50, 4096, 80 * GiB])
        me = random_share(rng, scale)
        others = [random_share(rng, scale) for _ in range(rng.randint(0, 5))]
        held = me.holds + sum(o.holds for o in others)
        # Mostly a budget that holds every hold; sometimes one the others already overrun.
        budget = held + rng.choice([0, 1, rng.randint(0, scale), rng.randint(0, 3 * scale), -rng.randint(0, scale)])
        granted = grant(me, others, budget)
        free = budget - sum(o.holds for o in others)
        assert granted + sum(o.holds for o in others) <= budget, (me, others, budget, granted)
        # The most it may raise its limit to: its wish, its entitlement and the free budget all bound it,
        # and one of them is reached.
        bounds = (me.wants, entitlement(me, others, budget), free)
        assert granted <= min(bounds) and granted in bounds, (me, others, budget, granted)
        if held <= budget:
            within += 1
    assert within > 3000


def test_grant_examples() -> None:
    me = Share(holds=GiB, wants=6 * GiB, floor=GiB)
    # Alone with room: the whole wish.
    assert grant(me, [], 10 * GiB) == 6 * GiB
    # Another holds 7 GiB of 10: only the 3 GiB left free.
    assert grant(me, [Share(holds=7 * GiB, wants=7 * GiB, floor=GiB)], 10 * GiB) == 3 * GiB
    # The others leave only what it holds free: no more than that.
    assert grant(me, [Share(holds=9 * GiB, wants=9 * GiB, floor=GiB)], 10 * GiB) == GiB
    # A wish below what it holds: the wish (no grow above it).
    assert grant(Share(holds=4 * GiB, wants=2 * GiB, floor=GiB), [], 10 * GiB) == 2 * GiB


def test_grant_under_contention_is_the_entitlement() -> None:
    me = Share(holds=GiB, wants=8 * GiB, floor=GiB)
    other = Share(holds=GiB, wants=5 * GiB, floor=GiB)
    budget = 10 * GiB  # wishes 13 GiB: contention; an even share each, 5 GiB
    assert grant(me, [other], budget) == 5 * GiB < me.wants
    assert grant(other, [me], budget) == 5 * GiB == other.wants


def test_give_back_is_none_when_nobody_needs() -> None:
    me = Share(holds=8 * GiB, wants=GiB, floor=GiB)
    # The other holds all it wants.
    assert give_back(me, [Share(holds=2 * GiB, wants=2 * GiB, floor=GiB)], 10 * GiB) is None
    # The other wants more, but the budget has that much free.
    assert give_back(me, [Share(holds=GiB, wants=2 * GiB, floor=GiB)], 10 * GiB) is None
    # Alone.
    assert give_back(me, [], 8 * GiB) is None


def test_give_back_gives_what_another_needs_beyond_the_free_budget() -> None:
    idle = Share(holds=6 * GiB, wants=GiB, floor=GiB // 2)
    needy = Share(holds=3 * GiB, wants=6 * GiB, floor=GiB // 2)
    # 1 GiB free, the needy one wants 3 GiB more: the idle one gives 2 GiB.
    assert give_back(idle, [needy], 10 * GiB) == 4 * GiB
    # The needy one wants 8 GiB more: the idle one keeps only its wish (all wishes fit).
    hungry = Share(holds=3 * GiB, wants=9 * GiB, floor=GiB // 2)
    assert give_back(idle, [hungry], 10 * GiB) == GiB


def test_an_idle_instance_gives_back_first() -> None:
    idle = Share(holds=50 * GiB, wants=10 * GiB, floor=5 * GiB)
    busy = Share(holds=30 * GiB, wants=30 * GiB, floor=5 * GiB)
    needy = Share(holds=20 * GiB, wants=60 * GiB, floor=5 * GiB)
    budget = 100 * GiB
    assert give_back(idle, [busy, needy], budget) == 10 * GiB
    assert give_back(busy, [idle, needy], budget) is None
    # Under contention (the busy one wants more too), still the idle one.
    busier = Share(holds=30 * GiB, wants=60 * GiB, floor=5 * GiB)
    back = give_back(idle, [busier, needy], budget)
    # Its wish is below an even share (33 GiB): it keeps its wish, gives the rest.
    assert back == entitlement(idle, [busier, needy], budget) == idle.wants
    assert give_back(busier, [idle, needy], budget) is None


def test_give_back_never_below_the_floor() -> None:
    starving = Share(holds=GiB, wants=64 * GiB, floor=GiB)
    # Idle (its wish is its floor): down to the floor, not below.
    idle = Share(holds=8 * GiB, wants=3 * GiB, floor=3 * GiB)
    assert give_back(idle, [starving], 9 * GiB) == 3 * GiB
    # Busy, under contention: its entitlement, which keeps the floor.
    busy = Share(holds=8 * GiB, wants=4 * GiB, floor=3 * GiB)
    back = give_back(busy, [starving], 9 * GiB)
    assert back == entitlement(busy, [starving], 9 * GiB) == 4 * GiB  # its wish, below an even share (4.5 GiB)
    at_floor = Share(holds=3 * GiB, wants=3 * GiB, floor=3 * GiB)
    assert give_back(at_floor, [starving], 4 * GiB) is None


def test_reclaim_only_while_another_waits_below_its_fair_share_for_what_this_one_holds() -> None:
    budget = 32
    # Gave back to 16 but still holds 27 (its drain waits for requests above 16); the other holds its floor.
    draining = Share(holds=27, wants=32, floor=5)
    waiting = Share(holds=5, wants=32, floor=5)
    assert must_reclaim(draining, [waiting], budget)
    # The other reached its fair share, or wishes for no more than it holds: nothing to reclaim.
    assert not must_reclaim(Share(holds=16, wants=32, floor=5), [Share(holds=16, wants=32, floor=5)], budget)
    assert not must_reclaim(draining, [Share(holds=5, wants=5, floor=5)], budget)
    # Short of its share by less than a chunk it could take: no reclaim for it.
    assert not must_reclaim(draining, [Share(holds=15, wants=32, floor=5)], budget, slack=2)
    assert must_reclaim(draining, [Share(holds=15, wants=32, floor=5)], budget)
    # The budget has room for the other's share without this one's blocks: no reclaim.
    assert not must_reclaim(Share(holds=10, wants=32, floor=5), [waiting], 48)


def test_reclaim_preempts_for_the_others_need_not_its_headroom() -> None:
    budget = 32
    draining = Share(holds=27, wants=32, floor=5, needs=20)
    # The needs fit (29 of 32): the other is entitled to 12, its need and a share of the rest as headroom.
    # Its requests need 9 blocks and it holds 10, so none of them waits: the drain goes on, no preemption.
    assert not must_reclaim(draining, [Share(holds=10, wants=32, floor=5, needs=9)], budget)
    # Its requests need 14 blocks and it holds 10: they wait for what this one holds above its limit.
    assert must_reclaim(draining, [Share(holds=10, wants=32, floor=5, needs=14)], budget)
    # What it needs beyond its fair share is not reclaimed either: only up to the share.
    assert must_reclaim(draining, [Share(holds=10, wants=32, floor=5, needs=30)], budget)
    assert not must_reclaim(draining, [Share(holds=16, wants=32, floor=5, needs=30)], budget)


def test_give_back_random_cases() -> None:
    rng = random.Random(99)
    gave = 0
    for _ in range(5000):
        scale = rng.choice([64, 10_000, 40 * GiB])
        me = random_share(rng, scale)
        others = [random_share(rng, scale) for _ in range(rng.randint(0, 4))]
        budget = me.holds + sum(o.holds for o in others) + rng.choice([0, 0, rng.randint(0, scale)])
        back = give_back(me, others, budget)
        free = budget - me.holds - sum(o.holds for o in others)
        needy = sum(max(0, o.wants - o.holds) for o in others)
        if back is None:
            continue
        gave += 1
        assert needy > free, (me, others, budget)
        assert me.floor <= back < me.holds
        # Gives no more than the others need beyond what is free ...
        assert me.holds - back <= needy - free
        # ... and keeps its entitlement (when it holds that much).
        assert back >= min(me.holds, entitlement(me, others, budget))
    assert gave > 500


def test_fits_floors() -> None:
    assert fits_floors(2 * GiB, [GiB, GiB], 4 * GiB)
    assert not fits_floors(2 * GiB, [GiB, GiB + 1], 4 * GiB)
    assert fits_floors(GiB, [], GiB)


# --- settings -----------------------------------------------------------------------


def test_settings_that_work_are_accepted() -> None:
    check_settings(None, False, None, None)
    check_settings(8 * GiB, False, None, None)
    check_settings(8 * GiB, True, None, None)
    check_settings(8 * GiB, True, 8 * GiB, None)
    check_settings(8 * GiB, True, GiB, 2 * GiB)
    check_settings(8 * GiB, True, GiB, GiB)
    check_settings(8 * GiB, True, None, GiB)


def test_floor_above_the_cap_is_refused_quoting_both() -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_settings(4 * GiB, True, 6 * GiB, None)
    text = str(info.value)
    for part in (
        "--kv-cache-min-memory 6GiB",
        f"({6 * GiB} bytes)",
        "--kv-cache-max-memory 4GiB",
        f"({4 * GiB} bytes)",
    ):
        assert part in text, text
    with pytest.raises(KVCacheMaxMemoryError, match=rf"\({4 * GiB + 1} bytes\) is above"):
        check_settings(4 * GiB, True, 4 * GiB + 1, None)


def test_budget_below_the_floor_is_refused_quoting_both() -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_settings(8 * GiB, True, 3 * GiB, 1536 * MiB)
    text = str(info.value)
    for part in (
        "--kv-cache-shared-budget 1.5GiB",
        f"({1536 * MiB} bytes)",
        "--kv-cache-min-memory 3GiB",
        f"({3 * GiB} bytes)",
    ):
        assert part in text, text


@pytest.mark.parametrize(
    ("min_memory", "budget", "named"),
    [
        (GiB, None, ["--kv-cache-min-memory"]),
        (None, GiB, ["--kv-cache-shared-budget"]),
        (GiB, 2 * GiB, ["--kv-cache-min-memory", "--kv-cache-shared-budget"]),
    ],
)
@pytest.mark.parametrize("cap", [None, 8 * GiB])
def test_min_memory_or_budget_without_autoscale_is_refused(
    cap: int | None, min_memory: int | None, budget: int | None, named: list[str]
) -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_settings(cap, False, min_memory, budget)
    text = str(info.value)
    assert "--kv-cache-autoscale" in text
    for flag in named:
        assert flag in text, text
    for flag in {"--kv-cache-min-memory", "--kv-cache-shared-budget"} - set(named):
        assert flag not in text, text


def test_autoscale_without_a_cap_is_refused_naming_the_cap_flag() -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_settings(None, True, None, None)
    assert "--kv-cache-autoscale" in str(info.value)
    assert "--kv-cache-max-memory" in str(info.value)


def test_shrink_after_s_from_the_environment() -> None:
    assert shrink_after_s({}) == DEFAULT_SHRINK_AFTER_S == 30.0
    assert shrink_after_s({envs.SHRINK_AFTER_S: ""}) == DEFAULT_SHRINK_AFTER_S
    assert shrink_after_s({envs.SHRINK_AFTER_S: "  "}) == DEFAULT_SHRINK_AFTER_S
    assert shrink_after_s({envs.SHRINK_AFTER_S: "0"}) == 0.0
    assert shrink_after_s({envs.SHRINK_AFTER_S: "2.5"}) == 2.5
    assert shrink_after_s({envs.SHRINK_AFTER_S: " 120 "}) == 120.0


def test_shrink_after_s_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(envs.SHRINK_AFTER_S, "7")
    assert shrink_after_s() == 7.0
    monkeypatch.delenv(envs.SHRINK_AFTER_S)
    assert shrink_after_s() == DEFAULT_SHRINK_AFTER_S


@pytest.mark.parametrize("raw", ["abc", "-1", "-0.5", "inf", "nan", "1e999", "30s", "1,5"])
def test_shrink_after_s_refuses_bad_values_quoting_them(raw: str) -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        shrink_after_s({envs.SHRINK_AFTER_S: raw})
    assert f"{envs.SHRINK_AFTER_S}={raw!r}" in str(info.value)


@pytest.mark.parametrize(
    ("smallest", "largest", "devices", "workers", "cpu", "expected"),
    [
        (1024, 0, 1, 1, True, 1024),
        # Tensor parallel 2 on one CPU memory node: two shares on it.
        (1024, 1024, 1, 2, True, 2048),
        # Two memory nodes: where each worker's pages lie is not known, so both count on each.
        (1024, 1024, 2, 2, True, 2048),
        # One worker a GPU.
        (1024, 1024, 2, 2, False, 1024),
        # Pipeline stages of unequal size on one node: the larger, twice (an upper bound).
        (512, 1536, 1, 2, True, 3072),
    ],
)
def test_a_block_on_a_device_counts_its_largest_worker_times_its_workers(
    smallest: int, largest: int, devices: int, workers: int, cpu: bool, expected: int
) -> None:
    allocation = Allocation(
        num_blocks=400,
        bytes_per_block=smallest,
        blocks_per_request=8,
        max_model_len=128,
        largest_bytes_per_block=largest,
    )
    assert device_bytes_per_block(allocation, devices, workers, cpu) == expected


@pytest.mark.parametrize(
    ("enabled", "backend", "ranks"),
    [
        (True, "mp", 2),
        (True, "ray", 4),
        (True, "uni", 1),
        (True, None, 1),
        (True, "external_launcher", 1),
        (False, "external_launcher", 2),
    ],
)
def test_executors_whose_ranks_share_one_scheduler_are_accepted(enabled: bool, backend: object, ranks: int) -> None:
    check_executor(enabled, backend, ranks)


def test_autoscale_with_ranks_that_each_schedule_is_refused_naming_the_backend() -> None:
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_executor(True, "external_launcher", 2)
    text = str(info.value)
    for part in ("--kv-cache-autoscale", "external_launcher", "2 tensor- or pipeline-parallel ranks", "mp or ray"):
        assert part in text, text


def test_lazy_release_from_the_environment() -> None:
    assert lazy_release({}) is True
    assert lazy_release({envs.LAZY_RELEASE: ""}) is True
    assert lazy_release({envs.LAZY_RELEASE: " 1 "}) is True
    assert lazy_release({envs.LAZY_RELEASE: "0"}) is False
    with pytest.raises(KVCacheMaxMemoryError, match=rf"{envs.LAZY_RELEASE}='no'.*{envs.LAZY_RELEASE}=0"):
        lazy_release({envs.LAZY_RELEASE: "no"})


def test_only_a_shrink_after_idling_releases_lazily() -> None:
    idle = "demand below the limit for 30 s"
    assert release_lazily(True, 100, 20, 400, idle)
    assert not release_lazily(False, 100, 20, 400, idle)  # turned off
    assert not release_lazily(True, 20, 100, 400, idle)  # a grow
    assert not release_lazily(True, 100, 100, 400, idle)  # no change
    assert not release_lazily(True, 500, 400, 400, idle)  # down to the ceiling
    assert not release_lazily(True, 100, 20, 400, "another instance needs the shared budget")
    assert not release_lazily(True, 100, 20, 400, "above the ceiling")
