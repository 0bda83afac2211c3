"""Autoscaled KV cache limits: the decisions, without vLLM.

With ``--kv-cache-autoscale`` the engine core moves its own run-time limit
(``resize``) between a floor and a ceiling (the start-up allocation, or
the last manual resize) as its demand changes. Demand is counted in
blocks: what every unfinished request will hold when it finishes (its
prompt and ``max_tokens``), an upper bound (blocks shared through the
prefix cache are counted once per request). The rules:

- **Grow at once** when the demand is more than the usable blocks under
  the limit (the requests need more blocks than it), to the demand plus
  headroom: as requests arrive, before any waits for a block.
- **Shrink in drain mode**, never by preempting, when the demand plus
  headroom has stayed below the limit for ``shrink_after_s`` seconds
  (hysteresis: a burst that pauses for less keeps its blocks), down to the
  demand plus headroom, never below the floor.
- Headroom: a quarter of the demand, and at least one request of
  ``max_model_len``, so a new request finds its blocks without waiting for
  a grow.

With a shared budget (``budget``) every instance publishes its need (its
demand) and its wish (its target), and the budget is split max-min fair,
by the needs first: when the wishes add up to more than the budget, each
instance is entitled to its need up to one level for all (water-filling),
never below its floor, and what the needs leave is split the same way as
headroom, so each with demand is guaranteed its need up to an even share,
and what one needs below it is lent to the others. One holding more than
its entitlement gives the rest back in drain mode, at once, so that idle
instances (small needs) give first; a drain that has not held after
``RECLAIM_AFTER_S`` while another instance waits below its entitlement
preempts the requests above its limit.

The vLLM glue is in ``hooks.runtime.autoscaler``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_kv_cache_limit.logic import envs, limit_math
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError, KVCacheResizeError
from vllm_kv_cache_limit.logic.limit_math import NULL_BLOCKS, Allocation
from vllm_kv_cache_limit.logic.sizes import format_size

HEADROOM = 0.25
"""Headroom over the demand, as a fraction of it."""
DEFAULT_SHRINK_AFTER_S = 30.0
"""Seconds the demand must stay below the limit before it shrinks."""
WISH_HOLD_S = 0.5
"""Seconds an instance's wish in a shared budget keeps the highest target it
had: a queue that empties between two waves of a burst, or a steady
instance whose demand dips between requests, keeps its share that long."""


@dataclass(frozen=True)
class Policy:
    """One engine's autoscaling bounds, in blocks (the null block included,
    as in vLLM's ``num_gpu_blocks``)."""

    floor: int
    """The least limit (``--kv-cache-min-memory``)."""
    blocks_per_request: int
    """Blocks one request of ``max_model_len`` needs: the least headroom."""
    shrink_after_s: float = DEFAULT_SHRINK_AFTER_S

    def target(self, demand: int, ceiling: int) -> int:
        """The limit that holds ``demand`` blocks in use plus headroom,
        within ``[floor, ceiling]``."""
        headroom = max(self.blocks_per_request, -(-demand * int(HEADROOM * 100) // 100))
        return max(self.floor, min(ceiling, demand + headroom + NULL_BLOCKS))


@dataclass
class Hysteresis:
    """The autoscaler's memory between ticks: since when the demand has
    been below the limit (None: it is not)."""

    policy: Policy
    below_since: float | None = None
    target: int = 0
    """The target of the last decision."""
    wish: int = 0
    """The highest target of the last ``WISH_HOLD_S`` seconds (at least the
    target): what the instance wishes for in a shared budget."""
    wish_at: float | None = None
    """When ``wish`` was last reached."""
    need: int = 0
    """The highest demand (with the null block, at least the floor) of the
    last ``WISH_HOLD_S`` seconds: what the shared budget splits first."""
    need_at: float | None = None

    def decide(self, now: float, demand: int, limit: int, ceiling: int) -> int | None:
        """The new limit for ``demand`` blocks at time ``now`` (None: keep
        ``limit``). A limit above the ceiling falls to it at once."""
        target = self.target = self.policy.target(demand, ceiling)
        self.hold(now, target, max(self.policy.floor, min(target, demand + NULL_BLOCKS)), ceiling)
        if limit > ceiling:
            self.below_since = None
            return ceiling
        if demand + NULL_BLOCKS > limit:  # the requests need more blocks than the limit
            self.below_since = None
            return target if target > limit else None
        if target >= limit:
            self.below_since = None
            return None
        if self.below_since is None:
            self.below_since = now
            return None
        if now - self.below_since < self.policy.shrink_after_s:
            return None
        self.below_since = None
        return target

    def hold(self, now: float, target: int, need: int, ceiling: int) -> None:
        """Raise the wish and the need at once; lower each only once it has
        not been reached for ``WISH_HOLD_S`` (never above the ceiling). Why:
        the shared budget splits by them, and figures that follow each
        request's arrival and finish would move every instance's share (and
        each move drains or preempts) several times a second."""
        if target >= self.wish or self.wish_at is None or now - self.wish_at >= WISH_HOLD_S:
            self.wish, self.wish_at = target, now
        if need >= self.need or self.need_at is None or now - self.need_at >= WISH_HOLD_S:
            self.need, self.need_at = need, now
        self.wish = min(self.wish, ceiling)
        self.need = min(self.need, self.wish)


@dataclass(frozen=True)
class Share:
    """One instance's entry in a device's shared budget, in bytes."""

    holds: int
    """What it may hold now: its limit, or while a lowered limit drains,
    the limit it had (its blocks above the new one are still in use)."""
    wants: int
    """Its target: demand plus headroom, within its floor and ceiling."""
    floor: int
    needs: int | None = None
    """Its demand without the headroom (None: as ``wants``, an entry that
    does not say): the budget is split by the needs first."""

    @property
    def need(self) -> int:
        """``needs`` within the floor and the wish."""
        return self.wants if self.needs is None else max(self.floor, min(self.needs, self.wants))


def _level(lows: list[int], highs: list[int], budget: int) -> list[int]:
    """Water-filling: ``max(low, min(high, level))`` each, at the highest
    level whose sum fits in ``budget`` (the lows at least)."""

    def at(level: int) -> list[int]:
        return [max(low, min(high, level)) for low, high in zip(lows, highs)]

    low, high = 0, max(highs, default=0)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if sum(at(mid)) <= budget else (low, mid - 1)
    return at(low)


def fair_shares(shares: list[Share], budget: int) -> list[int]:
    """What each instance of ``shares`` may hold under ``budget``: its wish
    when all wishes fit. Else max-min fair (water-filling), by the needs
    first: when the needs do not all fit, one level for all, each at least
    its floor and at most its need, so every instance is guaranteed its
    need up to an even share and what one needs less of is split evenly
    among the others; when they fit, each has its need and the rest of the
    budget is split the same way as headroom, up to each wish."""
    wants = [s.wants for s in shares]
    if sum(wants) <= budget:
        return wants
    needs = [s.need for s in shares]
    if sum(needs) >= budget:
        return _level([s.floor for s in shares], needs, budget)
    return _level(needs, wants, budget)


def entitlement(me: Share, others: list[Share], budget: int) -> int:
    """What ``me`` may hold under ``budget``: its :func:`fair_shares` entry
    beside ``others``, never below its floor."""
    return fair_shares([me, *others], budget)[0]


def grant(me: Share, others: list[Share], budget: int) -> int:
    """The most ``me`` may raise its limit to now: its wish, at most its
    entitlement (so that an instance that gave back under contention does
    not take it again at once) and what the others leave free of the
    budget."""
    free = budget - sum(o.holds for o in others)
    return min(me.wants, entitlement(me, others, budget), free)


def give_back(me: Share, others: list[Share], budget: int) -> int | None:
    """The hold ``me`` should lower to now because others need the budget
    (None: none). Only when another instance wishes for more than it holds
    and the budget has not that much free, or the holds add up to more than
    the budget (a starting instance holds what it committed before it could
    join); ``me`` keeps its entitlement."""
    free = budget - me.holds - sum(o.holds for o in others)
    needy = sum(max(0, o.wants - o.holds) for o in others)
    if needy <= free:
        return None
    keep = max(me.floor, min(me.holds, entitlement(me, others, budget)))
    # Give no more than the others need beyond what is free (what is over the budget counts as needed).
    keep = max(keep, me.holds - (needy - free))
    return keep if keep < me.holds else None


RECLAIM_AFTER_S = 0.2
"""Seconds a lowered limit may drain while another instance waits below its
fair share; then the requests holding blocks above it are preempted."""


def must_reclaim(me: Share, others: list[Share], budget: int, slack: int = 0) -> bool:
    """Whether another instance holds less than it is entitled to and needs
    (by more than ``slack``: a chunk it cannot take whole), and cannot grow
    there with what is free: the blocks ``me`` still holds above a lowered
    limit are then needed by the other's requests, and a drain that waits
    for its own to finish must not last (they are preempted after
    ``RECLAIM_AFTER_S``). Only the other's need counts, not its headroom: a
    preemption throws away work, so it is done for requests that wait, and
    headroom is given back by draining alone."""
    for index, other in enumerate(others):
        rest = [me, *others[:index], *others[index + 1 :]]
        due = min(other.need, entitlement(other, rest, budget))
        if other.holds + slack < due and budget - sum(s.holds for s in rest) < due:
            return True
    return False


def device_bytes_per_block(allocation: Allocation, devices: int, workers: int, cpu: bool) -> int:
    """Bytes a block of the limit takes on one device: the largest worker's
    share, times the workers a device may hold. On the CPU backend every
    local worker keeps its KV cache in the host's memory, on a node the
    plugin cannot tell, so each counts on every node (tensor parallel 2 on
    one node holds two shares there); on a GPU, one worker each. An upper
    bound, so that the ledger never holds less than the devices do."""
    largest = allocation.largest_bytes_per_block or allocation.bytes_per_block
    shares = workers if cpu else -(-workers // max(1, devices))
    return max(1, shares) * largest


def fits_floors(floor: int, other_floors: list[int], budget: int) -> bool:
    """Whether a budget holds this instance's floor and the others'."""
    return floor + sum(other_floors) <= budget


AUTOSCALE_FLAG = "--kv-cache-autoscale"
MIN_MEMORY_FLAG = "--kv-cache-min-memory"
SHARED_BUDGET_FLAG = "--kv-cache-shared-budget"


def check_settings(cap: int | None, enabled: bool, min_memory: int | None, shared_budget: int | None) -> None:
    """Refuse, quoting them, autoscaling settings that cannot work
    together, before anything loads. (A floor that cannot hold one request,
    and a budget below the floors of the instances sharing it, are refused
    once the block size and the others are known.)"""
    given = [
        flag
        for flag, value in ((MIN_MEMORY_FLAG, min_memory), (SHARED_BUDGET_FLAG, shared_budget))
        if value is not None
    ]
    if not enabled:
        if given:
            raise KVCacheMaxMemoryError(
                f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} only with {AUTOSCALE_FLAG}: add {AUTOSCALE_FLAG} (and a cap, "
                f"--kv-cache-max-memory SIZE), or leave {' and '.join(given)} out."
            )
        return
    if cap is None:
        raise KVCacheMaxMemoryError(
            f"{AUTOSCALE_FLAG} needs a cap: give --kv-cache-max-memory SIZE (the most the limit can grow to, "
            "allocated at start-up), for example --kv-cache-max-memory 8G."
        )
    if min_memory is not None and min_memory > cap:
        raise KVCacheMaxMemoryError(
            f"{MIN_MEMORY_FLAG} {format_size(min_memory)} ({min_memory} bytes) is above --kv-cache-max-memory "
            f"{format_size(cap)} ({cap} bytes): the floor must be at most the cap. Give a floor of at most "
            f"{format_size(cap)}, or a larger cap."
        )
    if shared_budget is not None and min_memory is not None and shared_budget < min_memory:
        raise KVCacheMaxMemoryError(
            f"{SHARED_BUDGET_FLAG} {format_size(shared_budget)} ({shared_budget} bytes) is below this instance's "
            f"{MIN_MEMORY_FLAG} {format_size(min_memory)} ({min_memory} bytes): the budget must hold every "
            "sharing instance's floor. Give a larger budget or a smaller floor."
        )


def check_executor(enabled: bool, backend: object, ranks: int) -> None:
    """Refuse autoscaling where the ranks of one model each run an engine of
    their own in lockstep (``external_launcher`` with tensor or pipeline
    parallel): they must schedule alike, and a limit each rank sets by its
    own clock would make their schedules differ, each waiting for the
    others' collectives."""
    if enabled and backend == "external_launcher" and ranks > 1:
        raise KVCacheMaxMemoryError(
            f"{AUTOSCALE_FLAG} cannot run with --distributed-executor-backend external_launcher and {ranks} "
            "tensor- or pipeline-parallel ranks: each rank's process schedules on its own and must schedule "
            "as the others do, and an autoscaled limit changes at a different moment in each. Leave out "
            f"{AUTOSCALE_FLAG} (a fixed --kv-cache-max-memory works there), or use the mp or ray backend."
        )


def shrink_after_s(environ: Mapping[str, str] | None = None) -> float:
    """``VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S``: the hysteresis, in seconds."""
    try:
        return envs.seconds(
            envs.SHRINK_AFTER_S,
            DEFAULT_SHRINK_AFTER_S,
            "30",
            "how long the demand must stay below the limit before it shrinks",
            os.environ if environ is None else environ,
        )
    except ValueError as exc:
        raise KVCacheMaxMemoryError(str(exc)) from None


def lazy_release(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_KV_CACHE_LIMIT_LAZY_RELEASE``: whether a shrink after idling
    returns the pages lazily (``1``, the default) or at once (``0``)."""
    raw = (os.environ if environ is None else environ).get(envs.LAZY_RELEASE, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise KVCacheMaxMemoryError(
        f"{envs.LAZY_RELEASE}={raw!r} is neither 0 nor 1; use {envs.LAZY_RELEASE}=0 to return the pages of an "
        f"idle autoscaled engine at once (MADV_DONTNEED), or 1 (the default) to return them lazily (MADV_FREE)."
    )


IDLE_REASON_PREFIX = "demand below the limit"
"""How the reason of a shrink after idling (the hysteresis) begins."""


def release_lazily(enabled: bool, limit: int, new: int, ceiling: int, reason: str) -> bool:
    """Whether the pages above a new limit go back lazily (``MADV_FREE``):
    only for a shrink after idling, within the ceiling, with lazy release
    ``enabled``. A fall to the ceiling (a manual resize) or for another
    instance of the shared budget, which may need the memory at once,
    returns the pages at once, as does any change that is not a fall."""
    return enabled and new < limit <= ceiling and reason.startswith(IDLE_REASON_PREFIX)


def floor_blocks(min_memory: int | None, allocation: Allocation) -> int:
    """The floor in blocks: ``--kv-cache-min-memory``, by default one
    request of ``max_model_len``; refused as resize refuses a limit that
    cannot hold one request, or above the start-up allocation."""
    if min_memory is None:
        return allocation.whole_chunks(allocation.blocks_per_request + limit_math.NULL_BLOCKS, up=True)
    try:
        return allocation.whole_chunks(limit_math.limit_for(min_memory, allocation), up=True)
    except KVCacheResizeError as exc:
        raise KVCacheMaxMemoryError(f"--kv-cache-min-memory {format_size(min_memory)} is refused: {exc}") from None


@dataclass
class Episode:
    """A run of decisions that could not be made, logged once when it
    starts and once when it ends (with how many there were), not at every
    decision."""

    since: float | None = None
    count: int = 0
    logged: bool = False

    def begin(self, now: float) -> bool:
        """Count one; whether it starts an episode."""
        self.count += 1
        if self.since is None:
            self.since = now
            return True
        return False

    def end(self, now: float) -> tuple[int, float] | None:
        """Close an episode in progress: (decisions, seconds), else None."""
        if self.since is None:
            return None
        ended = (self.count, now - self.since)
        self.since, self.count, self.logged = None, 0, False
        return ended

    def seconds(self, now: float) -> float | None:
        return None if self.since is None else round(now - self.since, 1)
