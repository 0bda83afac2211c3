"""The device the instances share, as a discrete-event loop on the virtual clock.

Compute is time-shared: the steps of all instances run one at a time on
the device, in the order their engine loops are ready (the earliest first;
a tie goes to the instance that waited longest). Each instance's engine
loop takes its next step as soon as its last one ended and it has
requests; while it has none its autoscaler still decides every
``TICK_S``, as the plugin's wake-ups make an idle engine core do.

With MPS the steps of several instances overlap (``overlap`` F, 0 to 1):
while k instances have requests, a step the step-time model times at t
seconds alone holds the device for t * (1 - F * (k - 1) / k). F = 0 is
strict time-sharing (each instance's step rate falls to 1/k of its rate
alone); F = 1 is full overlap (each instance steps as often as it would
alone, the device running k steps in the time of one). The events stay
one at a time on the virtual clock, so a step's own duration shrinks with
it: under overlap the time between an instance's steps is right, a single
step (a prefill's TTFT) reads up to F * (k - 1) / k of t short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_kv_cache_limit.hooks.runtime import utility_methods
from vllm_kv_cache_limit.hooks.runtime.autoscaler import TICK_S
from vllm_kv_cache_limit.sim.clock import VirtualClock
from vllm_kv_cache_limit.sim.instance import SAMPLE_S, Instance
from vllm_kv_cache_limit.sim.step_time import Batch, StepTimeModel

PROGRESS_S = 10.0
"""Seconds of the virtual clock between two calls of ``Device.progress``."""


@dataclass
class Overlapped:
    """A step-time model whose steps hold the device shorter while other instances are busy (``Device.overlap``)."""

    inner: StepTimeModel
    device: Device

    def seconds(self, batch: Batch) -> float:
        return self.inner.seconds(batch) * self.device.share()

    @property
    def name(self) -> str:
        return self.inner.name


@dataclass
class Device:
    """The instances on one device and the clock they run on."""

    clock: VirtualClock
    instances: list[Instance]
    drain_s: float = 600.0
    """Seconds after the last arrival the run goes on for requests still in flight."""
    free_at: float = 0.0
    """When the device ends the step it runs."""
    steps: int = 0
    limits: list[tuple[float, list[int]]] = field(default_factory=list)
    """(time, every instance's limit in blocks) after a step or an idle decision, at most one per ``SAMPLE_S``."""
    overlap: float = 0.0
    """How far steps of different instances overlap (MPS): 0 strict time-sharing, 1 full overlap."""
    progress: Callable[[float], None] | None = None
    """Called with the clock's time every ``PROGRESS_S`` of it (a progress bar)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap {self.overlap!r}: give a fraction from 0 (time-sharing) to 1 (full overlap)")
        if self.overlap:
            for instance in self.instances:
                instance.executor.step_time = Overlapped(instance.executor.step_time, self)

    def share(self) -> float:
        """The part of a step's time alone that it holds the device for now."""
        busy = sum(1 for instance in self.instances if instance.has_requests)
        return 1.0 - self.overlap * (busy - 1) / busy if busy > 1 else 1.0

    def run(self) -> None:
        """Every instance's traffic through vLLM's scheduler, until all
        requests have finished or ``drain_s`` after the last arrival."""
        last = max((i.arrivals[-1].at for i in self.instances if i.arrivals), default=0.0)
        horizon = last + self.drain_s
        idle_tick = self.clock.now
        reported = self.clock.now
        while True:
            if self.progress is not None and self.clock.now - reported >= PROGRESS_S:
                reported = self.clock.now
                self.progress(reported)
            nxt = self._next()
            if nxt is None:
                break
            start, instance = nxt
            if start > horizon:
                break
            # Idle instances decide every TICK_S up to the step's start.
            idle_tick = max(idle_tick, self.clock.now // TICK_S * TICK_S)
            while idle_tick + TICK_S <= start:
                idle_tick += TICK_S
                self._tick_idle(idle_tick)
            self.clock.advance_to(max(self.clock.now, start))
            instance.admit(self.clock.now)
            if not instance.has_requests:
                continue
            took = instance.step(self.clock.now)
            self.steps += 1
            self.sample()
            if took > 0:
                self.free_at = self.clock.now
        if self.progress is not None:
            self.progress(self.clock.now)

    def _next(self) -> tuple[float, Instance] | None:
        """When the next step starts, and whose: an instance with requests
        when its loop is ready and the device free, else at its next arrival."""
        best: tuple[float, float, int] | None = None
        chosen = None
        for index, instance in enumerate(self.instances):
            if instance.has_requests:
                ready = instance.ready_at
            else:
                arrival = instance.next_arrival_at()
                if arrival is None:
                    continue
                ready = max(arrival, instance.ready_at)
            start = max(ready, self.free_at, self.clock.now)
            key = (start, ready, index)
            if best is None or key < best:
                best, chosen = key, instance
        return None if best is None or chosen is None else (best[0], chosen)

    def _tick_idle(self, now: float) -> None:
        """The decision an idle instance's autoscaler makes (its wake-up)."""
        for instance in self.instances:
            if instance.has_requests:
                continue
            scaler = utility_methods.autoscaler_of(instance.core)
            limit = utility_methods.limit_of(instance.core)
            if scaler is None or limit is None:
                continue
            self.clock.advance_to(max(self.clock.now, now))
            limit.release_if_due()
            scaler.tick(instance.core, limit, self.clock.now)
            instance.sample(self.clock.now)
        self.sample()

    def sample(self) -> None:
        """Every instance's limit at the same instant."""
        now = self.clock.now
        if not self.limits or now - self.limits[-1][0] >= SAMPLE_S:
            self.limits.append((now, [instance.limit_blocks() for instance in self.instances]))
