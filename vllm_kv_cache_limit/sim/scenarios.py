"""The settings compared side by side, each one run of the same traffic on
the same device from a fresh start:

- ``even``: static caps, the budget split evenly (each instance allocates
  its share, ``--kv-cache-max-memory budget/n``, and keeps it);
- ``autoscale``: the plugin's autoscaling with one shared budget (each
  instance capped at the whole budget, ``--kv-cache-autoscale
  --kv-cache-shared-budget budget``), its floor and hysteresis as given.

The autoscaler, its run-time limit and its ledger (in a private lock folder)
are the plugin's own, started as ``start_autoscaling`` starts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_cache_limit.hooks.runtime import autoscaler, shared_budget, utility_methods
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.sim import metrics
from vllm_kv_cache_limit.sim.clock import VirtualClock, installed
from vllm_kv_cache_limit.sim.device import Device
from vllm_kv_cache_limit.sim.instance import Instance, InstanceSpec, SimExecutor, build_engine_core
from vllm_kv_cache_limit.sim.step_time import StepTimeModel
from vllm_kv_cache_limit.sim.traffic import Arrival

SCENARIOS = ("even", "autoscale")
SIM_DEVICE = ("sim-device", "the simulated device")
"""The one device of the simulation, as the ledger names it."""
PLUGIN_LOGGER = "vllm.plugins.kv_cache_limit"


@dataclass
class Setup:
    """One co-location question: the instances, their traffic and step times, and the memory they share."""

    specs: list[InstanceSpec]
    traffic: list[list[Arrival]]
    step_times: list[StepTimeModel]
    budget_bytes: int
    floors: list[int | None] = field(default_factory=list)
    """Each instance's ``--kv-cache-min-memory`` in bytes (None: the plugin's default)."""
    shrink_after_s: float = 30.0
    slo: metrics.SLO = field(default_factory=metrics.SLO)
    drain_s: float = 600.0
    verbose: bool = False


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _autoscaled(instance: Instance, floor: int | None, budget: int, folder: str, shrink_after_s: float) -> None:
    """The plugin's autoscaling on ``instance``'s engine core, as
    ``start_autoscaling`` starts it, in the shared budget's ledger of the
    simulated device; its decisions are the simulation's (no timer)."""
    core = instance.core
    cache_config = core.vllm_config.cache_config
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, floor)
    setattr(cache_config, autoscaler.SHARED_BUDGET, None)  # joined below, on the simulated device
    with _environment(envs.SHRINK_AFTER_S, repr(float(shrink_after_s))):
        start_autoscaling(core)
    scaler = utility_methods.autoscaler_of(core)
    limit = utility_methods.limit_of(core)
    assert scaler is not None and limit is not None
    scaler.stop.set()  # the in-process timer: the simulation decides instead
    if scaler.timer is not None:
        scaler.timer.join(timeout=5.0)
    scaler.budget = budget
    scaler.device_bytes_per_block = scaler.allocation.bytes_per_block
    shared_budget.join(scaler, [SIM_DEVICE], folder, committed=lambda: max(limit.limit, limit.committed))


def _instances(name: str, setup: Setup, clock: VirtualClock, folder: str) -> list[Instance]:
    n = len(setup.specs)
    built = []
    for index, spec in enumerate(setup.specs):
        executor = SimExecutor(clock, setup.step_times[index])
        cap = setup.budget_bytes // n if name == "even" else setup.budget_bytes
        core = build_engine_core(spec, cap, executor)
        built.append(Instance(spec, core, executor, list(setup.traffic[index])))
    if name == "autoscale":
        floors = setup.floors or [None] * n
        for instance, floor in zip(built, floors):
            _autoscaled(instance, floor, setup.budget_bytes, folder, setup.shrink_after_s)
    return built


def run(name: str, setup: Setup) -> dict[str, Any]:
    """One scenario on a fresh device and clock: each instance's figures."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r}: choose from {', '.join(SCENARIOS)}")
    clock = VirtualClock()
    quiet = logging.getLogger(PLUGIN_LOGGER)
    level = quiet.level
    if not setup.verbose:
        quiet.setLevel(logging.WARNING)  # the autoscaler's INFO line per change would drown the report
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-kv-sim-") as folder, installed(clock):
            instances = _instances(name, setup, clock, folder)
            try:
                device = Device(clock, instances, drain_s=setup.drain_s)
                device.run()
            finally:
                for instance in instances:
                    scaler = utility_methods.autoscaler_of(instance.core)
                    if scaler is not None:
                        scaler.close()
    finally:
        quiet.setLevel(level)
    span = max((a.at for t in setup.traffic for a in t), default=0.0)
    span = max(span, clock.now)
    result: dict[str, Any] = {"scenario": name, "simulated_s": clock.now, "device_steps": device.steps, "instances": {}}
    for instance in instances:
        figures = metrics.summary(instance.records.values(), span, setup.slo)
        scaler = utility_methods.autoscaler_of(instance.core)
        figures.update(
            preemptions=instance.preemptions,
            steps=instance.steps,
            busy_s=instance.busy_s,
            limit_changes=None if scaler is None else scaler.changes,
            limits_blocks=sorted({point[1] for point in instance.timeline}),
            num_blocks=instance.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        )
        result["instances"][instance.spec.name] = figures
    result["goodput_req_s"] = sum(i["goodput_req_s"] for i in result["instances"].values())
    result["device_busy"] = sum(i.busy_s for i in instances) / span if span else 0.0
    result["timelines"] = {i.spec.name: i.timeline for i in instances}
    result["limits"] = device.limits
    result["records"] = {i.spec.name: list(i.records.values()) for i in instances}
    return result
