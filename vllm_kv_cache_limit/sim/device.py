"""The device the instances share, as a discrete-event loop on the virtual clock.

Compute is time-shared: the steps of all instances run one at a time on
the device, in the order their engine loops are ready (the earliest first;
a tie goes to the instance that waited longest). Each instance's engine
loop takes its next step as soon as its last one ended and it has
requests; while it has none its autoscaler still decides every
``TICK_S``, as the plugin's wake-ups make an idle engine core do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_kv_cache_limit.hooks.runtime import utility_methods
from vllm_kv_cache_limit.hooks.runtime.autoscaler import TICK_S
from vllm_kv_cache_limit.sim.clock import VirtualClock
from vllm_kv_cache_limit.sim.instance import SAMPLE_S, Instance


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

    def run(self) -> None:
        """Every instance's traffic through vLLM's scheduler, until all
        requests have finished or ``drain_s`` after the last arrival."""
        last = max((i.arrivals[-1].at for i in self.instances if i.arrivals), default=0.0)
        horizon = last + self.drain_s
        idle_tick = self.clock.now
        while True:
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
