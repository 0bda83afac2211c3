"""vllm.v1.worker.cpu_worker: the CPU worker's two gates as ceilings, and the
cap checked after profiling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks import devices
from vllm_kv_cache_limit.hooks.apply import hook_ok
from vllm_kv_cache_limit.hooks.cap import ranks
from vllm_kv_cache_limit.hooks.cap.worker_gate import check_cap_fits_instance, cpu_gate_slack, log_gate
from vllm_kv_cache_limit.hooks.devices import cpu_free_memory, cpu_memory_node, cpu_node_memory
from vllm_kv_cache_limit.hooks.worker_state import Gate, WorkerState
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.cap_decision import (
    utilization_ceiling,
)
from vllm_kv_cache_limit.logic.kv_cache import rss_bytes


def patch(module: Any) -> None:
    """As ``patch``, for vLLM's CPU worker, whose two gates are in
    ``CPUWorker.__init__`` (``gpu_memory_utilization`` x the node's memory
    must be available) and at the start of
    ``CPUWorker.determine_available_memory`` (that request less the
    worker's resident memory must still be available). How: with a cap,
    ``__init__`` runs with the utilization lowered to what is available, and
    ``requested_cpu_memory`` is lowered likewise before the second gate."""
    if not (
        hook_ok(CPU_WORKER_INIT)
        and hook_ok(CPU_WORKER_DETERMINE_AVAILABLE_MEMORY)
        and hook_ok(devices.GET_MEMORY_NODE_INFO)
        and hook_ok(ranks.GET_WORLD_GROUP)
    ):
        return
    wrap(module.CPUWorker, "__init__", _ceiling_cpu_worker_init)
    wrap(
        module.CPUWorker,
        "determine_available_memory",
        _check_cap_fits_cpu,
    )


def _check_cap_fits_cpu(original: Callable) -> Callable:
    """``check_cap_fits_instance`` with the worker's memory node, and the CPU
    worker's second gate as a ceiling before vLLM's profiling."""
    return check_cap_fits_instance(cpu_free_memory, original, before_profile=_lower_cpu_request)


def _ceiling_cpu_worker_init(original: Callable) -> Callable:
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        cache_config = vllm_config.cache_config
        if cap_of(cache_config) is None or cache_config.kv_cache_memory_bytes is not None:
            # No cap, or an explicit size: vLLM skips the gate itself.
            return original(self, vllm_config, *args, **kwargs)
        # The node vLLM's gate in __init__ reads (self has no config yet).
        free, total, device = cpu_node_memory(cpu_memory_node(vllm_config.parallel_config))
        utilization = compat.gpu_memory_utilization(cache_config)
        # The field as given (None on vLLM 0.34+ when unset), restored as it was.
        given = cache_config.gpu_memory_utilization
        ceiling = utilization_ceiling(total, free, utilization, slack=cpu_gate_slack(free))
        if ceiling:
            compat.set_gpu_memory_utilization(cache_config, ceiling)
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            compat.set_gpu_memory_utilization(cache_config, given)
        gate = Gate(device, total, free, int(self.requested_cpu_memory), bool(ceiling))
        WorkerState.of_config(vllm_config, self).gate = gate
        log_gate(gate, utilization)
        return None

    return __init__


def _lower_cpu_request(worker: Any) -> None:
    """The CPU worker's second gate, as a ceiling: what it requested, at most
    its resident memory plus what is available now (less the slack)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    state = WorkerState.peek(worker.cache_config)
    gate = None if state is None else state.gate
    if gate is None:
        return
    requested = worker.requested_cpu_memory  # compat.ATTRIBUTES
    # vLLM's second gate (``determine_available_memory``) reads the first
    # allowed CPU's node: the memory node,
    # except where that is not a visible memory node. The first gate's
    # request already keeps to the memory node; this only lowers it.
    free, _, _ = cpu_node_memory(int(get_allowed_cpu_list()[0].numa_node))
    rss = rss_bytes()
    ceiling = rss + free - cpu_gate_slack(free)
    if ceiling < requested:
        worker.requested_cpu_memory = max(ceiling, 0)
        gate.requested = worker.requested_cpu_memory
        gate.limited_by_free = True
        gate.free = min(gate.free, free)


CPU_WORKER_INIT = Hook(
    ("vllm.v1.worker.cpu_worker",),
    "CPUWorker.__init__",
    ("self", "vllm_config"),
    wrapper=_ceiling_cpu_worker_init,
    upstream="none yet: the same ceiling in vLLM's CPU worker",
    remove_when="vLLM's CPU gate accepts an instance that fits",
)

CPU_WORKER_DETERMINE_AVAILABLE_MEMORY = Hook(
    ("vllm.v1.worker.cpu_worker",),
    "CPUWorker.determine_available_memory",
    ("self",),
    wrapper=_check_cap_fits_cpu,
    upstream="none yet: the cap checks where vLLM's CPU worker sizes its budget",
    remove_when="vLLM checks the cap against free memory itself",
)

HOOKS = (CPU_WORKER_INIT, CPU_WORKER_DETERMINE_AVAILABLE_MEMORY)

TARGETS = {"vllm.v1.worker.cpu_worker": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
