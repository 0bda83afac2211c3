"""The simulation's virtual clock, and the one place that puts it where
vLLM's and the plugin's code read the time.

vLLM's scheduler stamps each step (``time.monotonic``), a request its
arrival, the plugin's run-time limit its last change and the autoscaler its
decisions. In a simulation all of them must read the virtual clock, never
the wall clock: :func:`installed` swaps the ``time`` module those modules
see for a view of the clock while the simulation runs, and puts it back
after. A sleep inside the simulation is an error: nothing in it may wait.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
from collections.abc import Iterator

MODULE_PREFIXES = ("vllm.", "vllm_kv_cache_limit.")
"""Modules whose ``time`` is swapped: vLLM's and the plugin's (not the simulator's own)."""
SIM_PACKAGE = "vllm_kv_cache_limit.sim"


class SimulationSleeps(RuntimeError):
    """Code inside the simulation tried to sleep: it would wait on a clock that only its steps advance."""


class VirtualClock:
    """Seconds of simulated time; only the simulation advances it (``advance_to``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def advance_to(self, when: float) -> None:
        """Move the clock to ``when``; it never goes back."""
        if when < self.now:
            raise ValueError(f"the virtual clock cannot go back from {self.now} s to {when} s")
        self.now = float(when)

    def time(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)

    def sleep(self, seconds: float) -> None:
        raise SimulationSleeps(f"code inside the simulation tried to sleep {seconds} s; nothing in it may wait")

    def view(self) -> types.ModuleType:
        """A stand-in for the ``time`` module whose readings are this clock's."""
        view = types.ModuleType("time", "the simulation's virtual clock (vllm_kv_cache_limit.sim.clock)")
        for name in dir(time):
            if not name.startswith("__"):
                setattr(view, name, getattr(time, name))
        for name in ("time", "monotonic", "perf_counter"):
            setattr(view, name, self.time)
        for name in ("time_ns", "monotonic_ns", "perf_counter_ns"):
            setattr(view, name, self.time_ns)
        view.__dict__["sleep"] = self.sleep  # every sleep refused
        return view


def _targets() -> list[types.ModuleType]:
    """The loaded modules of vLLM and the plugin that read the time through the ``time`` module."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name.startswith(SIM_PACKAGE) or not name.startswith(MODULE_PREFIXES):
            continue
        if getattr(module, "time", None) is time:
            found.append(module)
    return found


@contextlib.contextmanager
def installed(clock: VirtualClock) -> Iterator[VirtualClock]:
    """vLLM's and the plugin's loaded modules read ``clock`` instead of the
    wall clock until the block ends (their ``time`` put back, whatever happens)."""
    view = clock.view()
    swapped = _targets()
    for module in swapped:
        module.time = view  # type: ignore[attr-defined]
    try:
        yield clock
    finally:
        for module in swapped:
            module.time = time  # type: ignore[attr-defined]
