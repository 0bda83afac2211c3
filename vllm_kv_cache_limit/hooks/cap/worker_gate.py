"""The workers' start-up gate as a ceiling, and the cap against what the
instance can get after vLLM's profiling (shared by the GPU and CPU workers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.cap.ranks import decide_together
from vllm_kv_cache_limit.hooks.worker_state import Gate, WorkerState
from vllm_kv_cache_limit.logic.cap_decision import (
    CAP_TOLERANCE,
    FLAG,
    CapDecision,
    check_cap_within_instance,
    check_explicit_size_within_free,
)
from vllm_kv_cache_limit.logic.sizes import format_gib, format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


CPU_GATE_SLACK_FRACTION = 0.01
"""On the CPU backend vLLM reads free memory again after our reading; ask for
1% (at least 16 MiB) less than what was free so that a few pages moving in
between do not fail its gate."""


def cpu_gate_slack(free: int) -> int:
    return max(16 * 2**20, int(free * CPU_GATE_SLACK_FRACTION))


def log_gate(gate: Gate, utilization: float) -> None:
    """One line per worker: what it requested at its first memory snapshot,
    and when (the start-up lock's logs show the windows do not overlap)."""
    wanted = int(gate.total * utilization)
    if gate.limited_by_free:
        logger.info(
            "--gpu-memory-utilization %s asks for %s GiB of the %s, but %s GiB is "
            "free at start-up; with %s the utilization is a ceiling, so this "
            "instance requests %s GiB (memory snapshot at %.3f).",
            utilization,
            format_gib(wanted),
            gate.device,
            format_gib(gate.free),
            FLAG,
            format_gib(gate.requested),
            time.time(),
        )
    else:
        logger.info(
            "--gpu-memory-utilization %s requests %s GiB of the %s; %s GiB is free "
            "at start-up (memory snapshot at %.3f).",
            utilization,
            format_gib(gate.requested),
            gate.device,
            format_gib(gate.free),
            time.time(),
        )


def check_cap_fits_instance(
    read_free: Callable[[Any], tuple[int, int, str]],
    original: Callable,
    before_profile: Callable[[Any], None] | None = None,
) -> Callable:
    """Why: a cap above what the device can still give this instance would
    silently not bind; an explicit size above the free memory would fail
    inside vLLM. How: wraps a worker's ``determine_available_memory``
    (``read_free`` reads its device; ``before_profile`` runs before vLLM's
    profiling: the CPU worker's second gate); every rank decides together."""

    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        cap = cap_of(self.cache_config)
        if cap is None:
            return original(self, *args, **kwargs)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            # vLLM allocates exactly this much without measuring.
            free, total, device = read_free(self)
            decide_together(lambda: check_explicit_size_within_free(min(explicit, cap), cap, free, total, device))
            record_worker_cap(self, int(explicit), cap)
            return original(self, *args, **kwargs)
        if before_profile is not None:
            before_profile(self)

        def profile_and_check() -> Any:
            # vLLM's own profiling runs inside the shared decision too, so a
            # rank where it raises still tells the others.
            budget = original(self, *args, **kwargs)
            gate = record_worker_cap(self, int(budget), cap).gate
            if gate is not None and gate.limited_by_free:
                non_kv = gate.requested - int(budget)
                above = check_cap_within_instance(cap, int(budget), gate.free, non_kv, gate.device)
                if above:
                    log_cap_within_tolerance(cap, int(budget), above, gate.device)
            return budget

        return decide_together(profile_and_check)

    return determine_available_memory


def log_cap_within_tolerance(cap: int, budget: int, above: int, device: str) -> None:
    """One line per worker whose cap the tolerance accepted: the cap is
    ``above`` bytes over the budget free memory left it, and the KV cache
    gets the budget, not the cap."""
    logger.info(
        "%s %s (%d bytes) is %d bytes (%.2f%%) above the %d bytes (%s GiB) that the %s can still give "
        "this instance's KV cache, within the %s%% tolerance for rounding and measurement drift: "
        "the KV cache gets the budget, %d bytes.",
        FLAG,
        format_size(cap, "up"),
        cap,
        above,
        100 * above / budget,
        budget,
        format_gib(budget),
        device,
        f"{float(CAP_TOLERANCE * 100):g}",
        budget,
    )


def record_worker_cap(worker: Any, budget: int, cap: int) -> WorkerState:
    """Keep the cap and this worker's budget in the worker's state, which its
    compilation config also holds: its model runner calls that config's
    ``resolve_cudagraph_mode_and_sizes`` once the KV cache is sized. Returns
    the state."""
    state = WorkerState.of_config(worker.vllm_config, worker, worker.cache_config)
    state.cap_decision = CapDecision(budget=budget, cap=cap)
    return state
