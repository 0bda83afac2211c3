"""vllm.v1.worker.gpu_worker: the utilization as a ceiling, and the cap checked
after profiling.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.apply import hook_ok, unenforced
from vllm_kv_cache_limit.hooks.cap import ranks
from vllm_kv_cache_limit.hooks.cap.worker_gate import check_cap_fits_instance, log_gate
from vllm_kv_cache_limit.hooks.devices import cuda_free_memory
from vllm_kv_cache_limit.hooks.worker_state import Gate, WorkerState
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.cap_decision import (
    utilization_ceiling,
)


def patch(module: Any) -> None:
    """Why: vLLM refuses to start unless ``gpu_memory_utilization`` x total is
    free (``request_memory``), whatever the cap; and a cap above what the
    device can still give this instance would silently not bind.
    How: wraps the ``request_memory`` the GPU worker imported (with a cap,
    the utilization becomes min(itself, free/total)), and
    ``Worker.determine_available_memory`` (after vLLM's own profiling, the
    cap against the budget when free memory set it; an explicit size against
    the free memory first)."""
    if not hook_ok(REQUEST_MEMORY):
        return
    if not hasattr(module, "request_memory"):  # imported under another name: nothing to wrap
        unenforced("vllm.v1.worker.gpu_worker.request_memory is missing")
        return
    wrap(module, "request_memory", _ceiling_request_memory)
    if hook_ok(WORKER_DETERMINE_AVAILABLE_MEMORY) and hook_ok(ranks.GET_WORLD_GROUP):
        wrap(module.Worker, "determine_available_memory", _check_cap_fits_gpu)


def _check_cap_fits_gpu(original: Callable) -> Callable:
    """``check_cap_fits_instance`` with the GPU's free memory (after
    ``torch.cuda.empty_cache()``)."""
    return check_cap_fits_instance(cuda_free_memory, original)


def _ceiling_request_memory(original: Callable) -> Callable:
    # vLLM 0.29-0.31: request_memory(init_snapshot, cache_config); 0.32+ adds
    # external_weight_memory. The arguments are passed on as received.
    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        cap = cap_of(cache_config)
        if cap is None:
            return original(init_snapshot, cache_config, *args, **kwargs)
        external = int(args[0] if args else kwargs.get("external_weight_memory", 0))
        total, free = int(init_snapshot.total_memory), int(init_snapshot.free_memory)
        utilization = compat.gpu_memory_utilization(cache_config)
        ceiling = utilization_ceiling(total, free, utilization, external)
        device = str(init_snapshot.device_)  # compat.ATTRIBUTES
        if ceiling:
            lowered = copy.copy(cache_config)
            compat.set_gpu_memory_utilization(lowered, ceiling)
            requested = original(init_snapshot, lowered, *args, **kwargs)
        else:
            requested = original(init_snapshot, cache_config, *args, **kwargs)
        # In the state on the worker's own cache_config, which its determine_available_memory reads.
        gate = Gate(device, total, free, int(requested), bool(ceiling))
        WorkerState.of(cache_config).gate = gate
        log_gate(gate, utilization)
        return requested

    return request_memory


REQUEST_MEMORY = Hook(
    ("vllm.v1.worker.gpu_worker",),
    "request_memory",
    ("init_snapshot", "cache_config"),
    wrapper=_ceiling_request_memory,
    upstream="none yet: a per-instance memory limit in `request_memory` (vllm #10533, #14376)",
    remove_when="vLLM's start-up gate accepts an instance that fits",
)

WORKER_DETERMINE_AVAILABLE_MEMORY = Hook(
    ("vllm.v1.worker.gpu_worker",),
    "Worker.determine_available_memory",
    ("self",),
    wrapper=_check_cap_fits_gpu,
    upstream="none yet: the cap checks where vLLM profiles (PR #56698, open, validates kv_cache_memory_bytes only)",
    remove_when="vLLM checks the cap against free memory itself",
)

HOOKS = (REQUEST_MEMORY, WORKER_DETERMINE_AVAILABLE_MEMORY)

TARGETS = {"vllm.v1.worker.gpu_worker": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
