"""The settings compared side by side, each one run of the same traffic on
the same device from a fresh start:

- ``no-cap``: vLLM's default, no plugin: each instance sizes its KV cache
  as vLLM does with ``--gpu-memory-utilization`` (``sim/memory.py``); one
  vLLM would refuse to start serves nothing and says why;
- ``even``: static caps, the budget split evenly (each instance allocates
  its share, ``--kv-cache-max-memory budget/n``, and keeps it);
- ``plan``: static caps from ``vllm-kv-plan`` within the budget (``sim/planned.py``);
- ``autoscale``: the plugin's autoscaling with one shared budget (each
  instance capped at the whole budget, ``--kv-cache-autoscale
  --kv-cache-shared-budget budget``), its floor and hysteresis as given;
- ``oracle``: one pool shared with no floors and no decision delay, the
  upper bound (``sim/oracle.py``).

The autoscaler, its run-time limit and its ledger (in a private lock folder)
are the plugin's own, started as ``start_autoscaling`` starts them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_cache_limit.hooks.runtime import autoscaler, shared_budget, utility_methods
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.sim import memory, metrics, oracle
from vllm_kv_cache_limit.sim.clock import VirtualClock, installed
from vllm_kv_cache_limit.sim.device import Device
from vllm_kv_cache_limit.sim.instance import Instance, InstanceSpec, SimExecutor, build_engine_core
from vllm_kv_cache_limit.sim.step_time import StepTimeModel
from vllm_kv_cache_limit.sim.traffic import Arrival

SCENARIOS = ("no-cap", "even", "plan", "autoscale", "oracle")
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
    device_bytes: int | None = None
    """The device's total memory (None: not checked; ``no-cap`` needs it)."""
    waiting_blocks: bool = False
    """Whether the timelines sum the blocks the waiting requests need (``--plot``; costs a walk of each queue)."""
    footprints: list[memory.Footprint] = field(default_factory=list)
    """Each instance's weights and activations (empty: estimated from its model folder)."""
    gpu_memory_utilization: float = 0.9
    """vLLM's ``--gpu-memory-utilization`` of each instance in ``no-cap``."""
    overlap: float = 0.0
    """How far the instances' steps overlap on the device (``Device.overlap``)."""
    static_caps: list[int] = field(default_factory=list)
    """Each instance's cap in the ``static`` run the recommendation search makes (not a scenario of its own)."""
    progress: Callable[[float], None] | None = None
    """Called with the virtual clock's time as the run goes on."""

    def memory(self) -> list[memory.Footprint]:
        """The instances' weights and activations, estimated once where not given."""
        if not self.footprints:
            self.footprints = [memory.footprint(spec) for spec in self.specs]
        return self.footprints


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


def _caps(name: str, setup: Setup) -> list[int | str]:
    """Each instance's KV cache bytes in scenario ``name``, or why it does not start;
    refused where they and the weights and activations cannot fit the device."""
    n, budget = len(setup.specs), setup.budget_bytes
    if name == "no-cap":
        if setup.device_bytes is None:
            raise memory.DeviceMemoryError(
                "scenario no-cap: vLLM sizes its KV cache from the device's memory; give --device-memory "
                "(e.g. 80GiB) or leave no-cap out of --scenarios."
            )
        return memory.no_cap_kv_bytes(setup.memory(), setup.device_bytes, setup.gpu_memory_utilization)
    if name == "plan":
        from vllm_kv_cache_limit.sim.planned import plan_caps

        caps: list[int | str] = [cap for cap, _, _ in plan_caps(setup.specs, budget)]
        what = "the planner's caps"
    elif name == "even":
        caps, what = [budget // n] * n, "the even caps"
    elif name == "static":
        caps, what = list(setup.static_caps), "the caps"
    else:
        caps, what = [budget] * n, "the shared budget"
    if setup.device_bytes is not None:
        kv = budget if name in ("autoscale", "oracle") else sum(int(c) for c in caps)
        memory.check_fits(name, kv, setup.memory(), setup.device_bytes, what)
    return caps


def _instances(name: str, setup: Setup, clock: VirtualClock, folder: str) -> tuple[list[Instance], dict[str, str]]:
    built, refused = [], {}
    for index, cap in enumerate(_caps(name, setup)):
        spec = setup.specs[index]
        if isinstance(cap, str):
            refused[spec.name] = cap
            continue
        executor = SimExecutor(clock, setup.step_times[index])
        core = build_engine_core(spec, cap, executor)
        instance = Instance(spec, core, executor, list(setup.traffic[index]))
        instance.waiting_blocks = setup.waiting_blocks
        built.append(instance)
    if name == "autoscale":
        floors = setup.floors or [None] * len(setup.specs)
        for instance, floor in zip(built, floors):
            _autoscaled(instance, floor, setup.budget_bytes, folder, setup.shrink_after_s)
    if name == "oracle":
        pools = [(i.core.scheduler.kv_cache_manager.block_pool, i.executor.bytes_per_block) for i in built]
        oracle.share(setup.budget_bytes, pools)
    return built, refused


def run(name: str, setup: Setup) -> dict[str, Any]:
    """One scenario on a fresh device and clock: each instance's figures."""
    if name not in SCENARIOS and name != "static":
        raise ValueError(f"scenario {name!r}: choose from {', '.join(SCENARIOS)}")
    clock = VirtualClock()
    quiet = logging.getLogger(PLUGIN_LOGGER)
    level = quiet.level
    if not setup.verbose:
        quiet.setLevel(logging.WARNING)  # the autoscaler's INFO line per change would drown the report
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-kv-sim-") as folder, installed(clock):
            instances, refused = _instances(name, setup, clock, folder)
            try:
                device = Device(clock, instances, drain_s=setup.drain_s, overlap=setup.overlap)
                device.progress = setup.progress
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
            kv_bytes=instance.executor.num_blocks * instance.executor.bytes_per_block,
        )
        result["instances"][instance.spec.name] = figures
    for index, spec in enumerate(setup.specs):
        if spec.name in refused:  # vLLM would not start it: none of its requests is served
            figures = metrics.summary([], span, setup.slo)
            figures.update(requests=len(setup.traffic[index]), slo_attainment=0.0, preemptions=0, steps=0, busy_s=0.0,
                           limit_changes=None, limits_blocks=[], num_blocks=0, kv_bytes=0, error=refused[spec.name])  # fmt: skip
            result["instances"][spec.name] = figures
    result["instances"] = {s.name: result["instances"][s.name] for s in setup.specs}
    result["goodput_req_s"] = sum(i["goodput_req_s"] for i in result["instances"].values())
    result["device_busy"] = sum(i.busy_s for i in instances) / span if span else 0.0
    result["timelines"] = {i.spec.name: i.timeline for i in instances}
    result["limits"] = device.limits
    result["records"] = {i.spec.name: list(i.records.values()) for i in instances}
    return result
