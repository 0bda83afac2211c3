"""The autoscaler of one engine core (``--kv-cache-autoscale``): its demand
read from the scheduler, its limit set through run-time resize, its share of
a device's budget kept in the ledger (``budget``). The decisions are in
``autoscale``; the hooks that call :meth:`Autoscaler.tick` between steps and
on the engine core's input queue are in ``hooks.runtime.engine_core``.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.hooks.runtime.demand import DemandReader, rose
from vllm_kv_cache_limit.logic import autoscale_policy, limit_math
from vllm_kv_cache_limit.logic.autoscale_policy import Episode, Hysteresis, Share
from vllm_kv_cache_limit.logic.budget_ledger import Ledger, LedgerBusy, View, others_in
from vllm_kv_cache_limit.logic.limit_math import Allocation
from vllm_kv_cache_limit.logic.sizes import format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

TICK_S = 0.1
"""Seconds between two decisions (and two wake-ups of an idle engine core)."""
LEDGER_LOCKED_LOG_S = 1.0
"""How long decisions find the ledger locked by another process before it
is logged (once): another instance's transaction holds it for a moment."""

AUTOSCALE = "kv_cache_autoscale"
MIN_MEMORY = "kv_cache_min_memory"
SHARED_BUDGET = "kv_cache_shared_budget"
"""The ``CacheConfig`` attributes the engine arguments are carried in."""


def _end_failing(failing: Episode, now: float) -> None:
    """A decision worked: end a run of failed ones, saying how long it was."""
    ended = failing.end(now)
    if ended is not None:
        logger.info("KV cache autoscaling works again after %d failed decisions over %.1f s.", ended[0], ended[1])


@dataclass
class Autoscaler:
    """One engine core's autoscaling state (on the engine core as ``_kvcl_autoscaler``)."""

    allocation: Allocation
    hysteresis: Hysteresis
    ceiling: int
    """Blocks: the start-up allocation, or the last manual resize."""
    set_limit: Callable[..., dict[str, Any]]
    """Sets the engine core's limit (``hooks.runtime.utility_methods.set_limit``;
    ``lazy=True`` returns the pages above it lazily)."""
    group_caps: list[tuple[int, int]]
    """Per KV cache group: tokens per block, and the most blocks one request needs."""
    max_model_len: int
    committable: Callable[[Any], int | None] | None = None
    """The most blocks the engine core's workers can commit now beside the
    memory vLLM keeps for activations (``hooks.runtime.committable``; None:
    no bound): a grow stops there, below the ceiling."""
    budget: int | None = None
    lazy_release: bool = True
    """A shrink after idling returns the pages lazily (``MADV_FREE``): the
    next burst finds them mapped unless the OS took them meanwhile. Every
    other fall (the ceiling, the shared budget) returns them at once."""
    device_bytes_per_block: int = 0
    """Bytes a block of the limit takes on one device, over this instance's
    workers there (two tensor-parallel workers on one CPU memory node hold
    twice a worker's share): the unit of its ledger entries. 0: one worker's."""
    ledgers: list[Ledger] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    """The devices whose ledgers hold this instance's entries, as people name them."""
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    """This instance's id in its entries on every device, so that one on
    several devices counts once (labels are for people: two containers of
    one pod can share a host name and a pid)."""
    held: int = 0
    """Blocks this instance's ledger entry holds: its limit, or while a
    lowered limit drains or its memory is not yet returned, what the
    workers may still commit (``RuntimeLimit.committed``); in the ledger as
    whole chunks (``held_blocks``)."""
    demand: int = 0
    lowered_at: float | None = None
    """When a lowered limit began to drain (None: it has drained)."""
    reclaim: bool = False
    """The last budget decision found another instance below its fair share
    that needs what this one holds (``autoscale_policy.must_reclaim``)."""
    others: list[dict[str, Any]] = field(default_factory=list)
    last_tick: float = 0.0
    reader: DemandReader = field(init=False)
    changes: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    orphaned: bool = False
    """The process that started this engine core is gone (``wakeups.start_waking``):
    its shutdown ends the workers first (``wakeups.end_children``)."""
    ledger_busy: Episode = field(default_factory=lambda: Episode())
    """Decisions that found the ledger locked by another process (and kept the limit)."""
    failing: Episode = field(default_factory=lambda: Episode())
    """Decisions that failed with an error (and kept the limit)."""
    timer: threading.Thread | None = None
    """An in-process engine core's timer (``start_deciding``), else None."""
    close_when_stopped: bool = False
    """Set by a shutdown that could not wait for the timer's decision: the
    timer closes the ledgers once its decision ends."""
    _closing: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.reader = DemandReader(self.group_caps, self.max_model_len)

    @property
    def floor(self) -> int:
        return self.hysteresis.policy.floor

    @property
    def unit(self) -> int:
        """Bytes of the ledger per block of the limit (``device_bytes_per_block``)."""
        return self.device_bytes_per_block or self.allocation.bytes_per_block

    @property
    def held_blocks(self) -> int:
        """``held`` in the whole chunks the workers commit: a limit inside a
        chunk (a manual ceiling) keeps that chunk mapped, so it counts."""
        return self.allocation.whole_chunks(self.held, up=True)

    @property
    def target(self) -> int:
        """The limit the last decision's demand asks for (the scaler's)."""
        return self.hysteresis.target

    @property
    def wants(self) -> int:
        """The wish (the highest target of the last ``WISH_HOLD_S`` seconds)
        in the whole chunks a limit is set in (its entry's ``wants``)."""
        return self.allocation.whole_chunks(max(self.target, self.hysteresis.wish), up=True)

    @property
    def needs(self) -> int:
        """The need (the highest demand of the last ``WISH_HOLD_S`` seconds,
        with the null block, without headroom) in whole chunks, at most the
        wish (its entry's ``needs``)."""
        return min(self.wants, self.allocation.whole_chunks(max(self.floor, self.hysteresis.need), up=True))

    def read_demand(self, scheduler: Any) -> int:
        """Blocks every unfinished request holds and will need to finish
        (its prompt and ``max_tokens``, at most ``max_model_len``), per KV
        cache group: an upper bound, so that a burst's limit grows as its
        requests arrive, not once they wait for blocks. Counted up to the
        ceiling: every decision is the same above it."""
        return self.reader.read(scheduler, self.ceiling)

    def tick(self, engine_core: Any, pool_limit: Any, now: float | None = None) -> None:
        """One decision, at most every ``TICK_S`` unless requests that
        arrived raise the demand above the limit (a grow is decided at once);
        never raises into vLLM. The whole demand is read once per decision;
        between them only the arrivals (``DemandReader.may_rise``)."""
        now = time.monotonic() if now is None else now
        try:
            scheduler, reader, due = engine_core.scheduler, self.reader, now - self.last_tick >= TICK_S
            if not due and not reader.may_rise(scheduler, self.demand, pool_limit.limit):
                return
            demand = self.read_demand(scheduler)
            if not due and not rose(demand, self.demand, pool_limit.limit):
                reader.wait_for_tick = True  # counted requests had finished: the rest waits for the tick
                return
            self.last_tick = now
            self._tick(engine_core, pool_limit, now, demand)
            reader.wait_for_tick = demand + limit_math.NULL_BLOCKS > pool_limit.limit  # could not grow to it
        except Exception:
            if self.failing.begin(now):
                logger.exception(
                    "KV cache autoscaling failed in this step; the limit stays at %d blocks (logged once until "
                    "a decision works again).",
                    pool_limit.limit,
                )
        else:
            _end_failing(self.failing, now)

    def _tick(self, engine_core: Any, state: Any, now: float, demand: int) -> None:
        limit = state.limit
        self.demand = demand
        new = self.hysteresis.decide(now, demand, limit, self.ceiling)
        # Drained: what is held falls to what the workers still commit
        # (their memory above the limit may not be returned yet).
        drained = len(state.withheld) == self.allocation.num_blocks - limit
        settled = max(limit, getattr(state, "committed", limit)) if drained else None
        if new is None:
            reason = ""
        elif new > limit:
            reason = "requests need more blocks than the limit"
        elif limit > self.ceiling:
            reason = "above the ceiling"
        else:
            reason = f"{autoscale_policy.IDLE_REASON_PREFIX} for {self.hysteresis.policy.shrink_after_s:g} s"
        if new is not None:
            # Whole chunks where the workers map chunks: the limit then holds
            # exactly the memory it commits, and the ledger says so.
            rounded = min(self.allocation.whole_chunks(new, up=True), max(new, self.ceiling))
            new = None if (rounded >= limit) != (new >= limit) or rounded == limit else rounded
        if new is not None and new > limit and self.committable is not None:
            most = self.committable(engine_core)
            new = new if most is None else min(new, most)
            new = new if new > limit else None
        held = self.held
        if self.budget is not None:
            new, gave = self._within_budget(limit, new, settled, now)
            if gave:
                reason = "another instance needs the shared budget"
        if drained:
            self.lowered_at = None
        elif new is None and self.budget is not None:
            self._reclaim(engine_core, state, now)
        if new is None or new == limit:
            return
        lazy = autoscale_policy.release_lazily(self.lazy_release, limit, new, self.ceiling, reason)
        if self.apply(engine_core, limit, new, reason, lazy):
            if new < limit and self.lowered_at is None:
                self.lowered_at = now
        elif self.held != held:
            self._take_back(held)

    def _reclaim(self, engine_core: Any, state: Any, now: float) -> None:
        """A lowered limit that has drained for ``RECLAIM_AFTER_S`` while
        another instance waits below its fair share: preempt the requests
        that hold blocks above it (vLLM recomputes them), so that the budget
        moves within a bound, not when the longest of them finishes."""
        waited = now - (now if self.lowered_at is None else self.lowered_at)
        if not self.reclaim or waited < autoscale_policy.RECLAIM_AFTER_S:
            return
        logger.info(
            "KV cache autoscale: the limit of %d blocks has not drained for %.1f s while another instance waits "
            "below its fair share of the shared budget; preempting the requests that hold blocks above it.",
            state.limit,
            waited,
        )
        state.preempt(engine_core.scheduler)
        self.lowered_at = now  # tried again after as long, if blocks above are still in use

    def _take_back(self, held: int) -> None:
        """A grow the ledger granted but the engine could not apply: the
        entry holds what it held before (all of the change or none of it).
        With the ledger locked by another process this waits for the next
        decision, which writes the entry again."""
        self.held = held
        try:
            with self.transaction(wait=False) as views:
                self._write(views)
        except LedgerBusy:
            pass

    def apply(self, engine_core: Any, old: int, new: int, reason: str, lazy: bool = False) -> bool:
        """Set the limit (``lazy``: the pages above it go back lazily); whether it was set."""
        bpb = self.allocation.bytes_per_block
        reply = self.set_limit(engine_core, new * bpb, "drain", lazy=lazy)
        if limit_math.is_error(reply):
            logger.warning("KV cache autoscaling could not set the limit to %d blocks: %s", new, reply["error"])
            return False
        self.changes += 1
        logger.info(
            "KV cache autoscale: limit %s -> %s per worker (%d -> %d blocks of %d allocated; demand %d blocks; %s)%s.",
            format_size(old * bpb),
            format_size(new * bpb),
            old,
            new,
            self.allocation.num_blocks,
            self.demand,
            reason,
            self._budget_text(),
        )
        return True

    def _budget_text(self) -> str:
        if self.budget is None:
            return ""
        others = sum(int(o["holds"]) for o in self.others)
        names = ", ".join(str(o.get("label")) for o in self.others) or "none"
        where = f" of {', '.join(self.devices)}" if self.devices else ""
        return f"; shared budget {format_size(self.budget)}{where}, others hold {format_size(others)} ({names})"

    def _shares(self, holds: int) -> tuple[Share, list[Share]]:
        unit = self.unit
        me = Share(holds=holds * unit, wants=self.wants * unit, floor=self.floor * unit, needs=self.needs * unit)
        return me, [
            Share(
                int(o["holds"]), int(o["wants"]), int(o["floor"]), None if o.get("needs") is None else int(o["needs"])
            )
            for o in self.others
        ]

    def _within_budget(
        self, limit: int, new: int | None, settled: int | None, now: float | None = None
    ) -> tuple[int | None, bool]:
        """``new`` bounded by the ledger, and a give-back when others need
        the budget; writes this instance's entry. When another process holds
        a ledger's lock, no change (the limit in force is one the budget
        granted): tried again at a later decision, never waited for."""
        assert self.budget is not None
        now = time.monotonic() if now is None else now
        try:
            decided = self._decide_within_budget(limit, new, settled)
        except LedgerBusy as exc:
            busy = self.ledger_busy
            busy.begin(now)
            if not busy.logged and busy.since is not None and now - busy.since >= LEDGER_LOCKED_LOG_S:
                busy.logged = True
                logger.warning(
                    "KV cache autoscaling: the shared budget's ledger %s (for %.1f s); the limit stays at %d "
                    "blocks until it is free (tried again at each decision, never waited for; logged once).",
                    exc,
                    now - busy.since,
                    limit,
                )
            return None, False
        logged = self.ledger_busy.logged
        ended = self.ledger_busy.end(now)
        if ended is not None and logged:
            logger.info(
                "KV cache autoscaling: the shared budget's ledger is free again after %.1f s "
                "(%d decisions kept the limit).",
                ended[1],
                ended[0],
            )
        return decided

    def _decide_within_budget(self, limit: int, new: int | None, settled: int | None) -> tuple[int | None, bool]:
        """``settled``: what the workers may still commit once a lowered
        limit has drained (None: it has not), which the entry falls to."""
        assert self.budget is not None
        unit = self.unit
        with self.transaction(wait=False) as views:
            self.others = others_in(views)
            if settled is not None:
                self.held = settled
            me, others = self._shares(self.held_blocks)
            chunk = self.allocation.blocks_per_chunk * unit
            self.reclaim = autoscale_policy.must_reclaim(me, others, self.budget, chunk)
            if new is not None and new > limit:
                granted = self.allocation.whole_chunks(
                    autoscale_policy.grant(me, others, self.budget) // unit, up=False
                )
                new = min(new, granted) if granted > limit else None
            gave = False
            if new is None or new <= limit:
                back = autoscale_policy.give_back(me, others, self.budget)
                keep = None if back is None else max(self.floor, self.allocation.whole_chunks(back // unit, up=False))
                if keep is not None and keep < min(new or limit, limit):
                    self.hysteresis.below_since = None
                    new, gave = keep, True
            if new is not None and new > limit:
                self.held = max(self.held, new)
            self._write(views)
        return new, gave

    @contextlib.contextmanager
    def transaction(self, wait: bool = True) -> Any:
        """Every device's ledger under its lock; ``wait=False``: raise
        ``LedgerBusy`` at once (having released any taken) when one is held."""
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(ledger.transaction(wait)) for ledger in self.ledgers]

    def _write(self, views: list[View]) -> None:
        """This instance's entry in every ledger, unless it is unchanged."""
        unit = self.unit
        record = {
            "instance": self.instance,
            "budget": self.budget,
            "floor": self.floor * unit,
            "holds": self.held_blocks * unit,
            "wants": self.wants * unit,
            "needs": self.needs * unit,
        }
        for view in views:
            if view.ledger.record != record:
                view.write(record)

    def status(self) -> dict[str, Any]:
        bpb = self.allocation.bytes_per_block
        return {
            "floor_bytes": self.floor * bpb,
            "ceiling_bytes": self.ceiling * bpb,
            "demand_blocks": self.demand,
            "target_bytes": self.target * bpb,
            "changes": self.changes,
            "shared_budget": self.budget,
            "held_bytes": self.held_blocks * self.unit if self.budget is not None else None,
            "devices": list(self.devices) if self.budget is not None else None,
            "others": [{k: o.get(k) for k in ("label", "holds", "wants", "needs", "floor")} for o in self.others],
            "ledger_locked_s": self.ledger_busy.seconds(time.monotonic()),
            "failing_s": self.failing.seconds(time.monotonic()),
        }

    def close(self) -> None:
        """Stop deciding and leave every ledger; once, from any thread."""
        self.stop.set()
        with self._closing:
            ledgers, self.ledgers = self.ledgers, []
            for ledger in ledgers:
                ledger.close()
