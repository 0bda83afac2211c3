"""vllm.v1.engine.core: the block count under the cap, its errors, and the
start-up lock around the engine core's start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.config import cap_of
from vllm_kv_cache_limit.hooks.apply import hook_ok, name_cap_when_refused
from vllm_kv_cache_limit.hooks.devices import instance_devices
from vllm_kv_cache_limit.hooks.runtime import engine_entry, shared_budget
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import startup_lock
from vllm_kv_cache_limit.logic.cap_decision import (
    CapDecision,
    auto_fit_message,
    cap_block_override,
    cap_error_message,
    too_small_message,
)
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError, KVCacheResizeError
from vllm_kv_cache_limit.logic.kv_cache import backing_bytes
from vllm_kv_cache_limit.logic.relay import relay_cap_error
from vllm_kv_cache_limit.logic.sizes import format_gib, format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


_active = threading.local()


def patch(module: Any) -> None:
    """Why: the engine core turns each worker's KV budget into the number of
    blocks in ``get_kv_cache_configs``; the cap belongs there.
    How: wraps the engine core's ``get_kv_cache_configs`` and, in the module
    that defines it, ``_check_enough_kv_cache_memory`` (for an error that
    names the cap)."""
    if not (hook_ok(GET_KV_CACHE_CONFIGS) and hook_ok(CHECK_ENOUGH_KV_CACHE_MEMORY) and hook_ok(ENGINE_CORE_INIT)):
        return
    wrap(module.EngineCore, "__init__", _hold_startup_lock)
    wrap(module, "get_kv_cache_configs", _cap_kv_cache_configs)
    planner, _ = compat.resolve_hook(CHECK_ENOUGH_KV_CACHE_MEMORY)
    planner_module = __import__(planner.__module__, fromlist=["_"])
    wrap(planner_module, "_check_enough_kv_cache_memory", _name_cap_when_too_small)
    if hook_ok(AUTO_FIT_MAX_MODEL_LEN):
        wrap(planner_module, "_auto_fit_max_model_len", _name_cap_when_auto_fit_fails)
    if FINALIZE_EXTENSIBLE_KV_CACHE.applies(compat.installed_vllm_version()) and hook_ok(FINALIZE_EXTENSIBLE_KV_CACHE):
        wrap(module, "finalize_extensible_kv_cache", _report_final_size)


def _hold_startup_lock(original: Callable) -> Callable:
    """Why: instances that measure memory at the same time count each other's
    memory (see ``startup_lock``). How: with a cap, ``EngineCore.__init__``
    (which starts the workers, profiles, allocates the KV cache and warms up,
    capturing CUDA graphs) runs holding the start-up lock of every local
    device; a cap error it fails with (also one a Ray worker on another node
    raised) goes to the relay for the first process, and an engine-core
    process that relayed it logs it once, without a traceback, and exits."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if cap_of(vllm_config.cache_config) is None:
            return original(self, vllm_config, *args, **kwargs)

        def start() -> None:
            _active.committed = None
            reservation = shared_budget.reserve(vllm_config)  # before vLLM commits the KV cache
            try:
                original(self, vllm_config, *args, **kwargs)
                _start_at_committed(self)
                _start_autoscaling(self, vllm_config, reservation)
            except BaseException:
                if reservation is not None:
                    shared_budget.leave_after_failure(self, reservation)
                raise
            engine_entry.start(self, vllm_config)

        try:
            if not startup_lock.enabled():
                return start()
            if vllm_config.parallel_config.data_parallel_size > 1:
                # Only a mixture-of-experts model keeps data_parallel_size > 1
                # in its engine cores (vLLM runs a dense model's ranks as
                # independent DP=1 engines). Its ranks start in lockstep, their
                # workers joining one process group: a rank holding the lock
                # would wait for a rank waiting for the lock.
                logger.info(
                    "No KV cache start-up lock for data-parallel rank %d of %d: the ranks of a "
                    "mixture-of-experts model start together, and a lock between them would deadlock.",
                    vllm_config.parallel_config.data_parallel_rank,
                    vllm_config.parallel_config.data_parallel_size,
                )
                return start()
            try:
                devices, _ = instance_devices(vllm_config)
            except Exception as exc:
                logger.warning("No KV cache start-up lock: the devices could not be named (%r).", exc)
                devices = []
            with startup_lock.acquire([(d.key, d.label) for d in devices]):
                return start()
        except Exception as exc:
            # A worker on another node (Ray) cannot reach the relay file; its
            # error reaches this process inside the executor's exception.
            message = cap_error_message(exc)
            if message and relay_cap_error(message) and _in_own_process(self):
                # vLLM would log it with its traceback, the process would print
                # it again, and the first process raise it a third time: said
                # once here, and raised by the first process (engine_utils).
                logger.error("EngineCore failed to start: %s%s", message, _reported_as(exc))
                raise SystemExit(1) from None
            raise

    return __init__


def _reported_as(exc: BaseException) -> str:
    """How a cap error raised elsewhere (a worker) reached the engine core, as
    vLLM reported it (its first line); empty for the plugin's own error."""
    if isinstance(exc, KVCacheMaxMemoryError):
        return ""
    lines = str(exc).strip().splitlines()
    return f" (reported to the engine core as {type(exc).__name__}: {lines[0] if lines else ''})"


def _in_own_process(engine_core: Any) -> bool:
    """Whether ``engine_core`` is vLLM's engine-core process (``EngineCoreProc``
    started by ``run_engine_core`` in a child process), which may end with
    ``SystemExit``; not an in-process engine core, whose process is the user's."""
    import multiprocessing

    from vllm.v1.engine.core import EngineCoreProc

    return isinstance(engine_core, EngineCoreProc) and multiprocessing.parent_process() is not None


def _start_at_committed(engine_core: Any) -> None:
    """Where the block pool covers the cap's reservation but warmup left
    room for fewer blocks (``_report_final_size``), start with a run-time
    limit at the blocks committed; it can grow to the cap later."""
    committed = getattr(_active, "committed", None)
    _active.committed = None
    if committed is None:
        return
    from vllm_kv_cache_limit.hooks.runtime.utility_methods import start_at

    start_at(engine_core, committed)


def _start_autoscaling(
    engine_core: Any, vllm_config: Any, reservation: shared_budget.Reservation | None = None
) -> None:
    """With ``--kv-cache-autoscale``, start it before the start-up lock is
    released (its pages above the floor go back first, then its entries
    fall from the ``reservation``); fail closed when run-time resize is not
    there to do it."""
    if not getattr(vllm_config.cache_config, "kv_cache_autoscale", False):
        return
    from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling

    start_autoscaling(engine_core, reservation)  # refuses, naming the hook, where resizing cannot work


def _cap_kv_cache_configs(original: Callable) -> Callable:
    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: Any, available_memory: list[int], *args: Any, **kwargs: Any
    ) -> Any:
        cache_config = vllm_config.cache_config
        cap = cap_of(cache_config)
        if cap is None:
            return original(vllm_config, kv_cache_specs, available_memory, *args, **kwargs)
        decisions = [CapDecision(budget=m, cap=cap) for m in available_memory]
        capped = [d.kv_bytes for d in decisions]
        _active.decision = decisions
        try:
            override = cache_config.num_gpu_blocks_override
            if override is not None:
                # vLLM's own block count for exactly `cap` bytes, override off.
                cache_config.num_gpu_blocks_override = None
                try:
                    fit = original(vllm_config, kv_cache_specs, [cap] * len(capped), *args, **kwargs)
                finally:
                    cache_config.num_gpu_blocks_override = override
                reduced, warning = cap_block_override(override, min(c.num_blocks for c in fit), cap)
                if warning:
                    logger.warning(warning)
                    cache_config.num_gpu_blocks_override = reduced
            configs = original(vllm_config, kv_cache_specs, capped, *args, **kwargs)
        finally:
            _active.decision = None
        _log_decision(vllm_config, decisions, configs)
        _active.settled = decisions
        return configs

    return get_kv_cache_configs


def _report_final_size(original: Callable) -> Callable:
    """Why: under vLLM 0.34's extensible KV cache, the size decided in
    ``get_kv_cache_configs`` is only the reservation (within the cap); vLLM
    commits the smaller of it and what every rank measured after warmup.
    How: wraps ``finalize_extensible_kv_cache``; with a cap, a refusal it
    raises (``--max-model-len auto`` fitted again) names the cap when the cap
    bound the reservation and warmup left more, and one INFO line gives the
    final size."""

    def finalize_extensible_kv_cache(
        vllm_config: Any, kv_cache_configs: list[Any], scheduler_kv_cache_config: Any, compilation_times: Any
    ) -> int:
        settled = getattr(_active, "settled", None)
        cap = cap_of(vllm_config.cache_config)
        if cap is None or not settled:
            return original(vllm_config, kv_cache_configs, scheduler_kv_cache_config, compilation_times)
        reserved = scheduler_kv_cache_config.num_blocks
        measured = [t.num_kv_blocks for t in compilation_times if getattr(t, "num_kv_blocks", None) is not None]
        cap_binds = any(d.bound for d in settled) and (not measured or min(measured) >= reserved)
        _active.decision = settled if cap_binds else None
        configs = [*kv_cache_configs, scheduler_kv_cache_config]
        planned = [(config, config.num_blocks, list(config.kv_cache_tensors)) for config in configs]
        try:
            num_blocks = original(vllm_config, kv_cache_configs, scheduler_kv_cache_config, compilation_times)
        finally:
            _active.decision = None
            _active.settled = None
        committed = max(backing_bytes(c) for c in kv_cache_configs)
        logger.info(
            "KV cache max memory: the extensible KV cache settled after warmup at %d blocks, %d bytes "
            "(%s GiB) per device, under the cap %s: %s of the %d blocks reserved.",
            num_blocks,
            committed,
            format_gib(committed),
            format_size(cap, "up"),
            "all (the cap binds)"
            if num_blocks >= reserved
            else f"fewer than (vLLM measured {min(measured) if measured else num_blocks} blocks' memory free after warmup)",
            reserved,
        )
        if num_blocks < reserved and _reserve_for_cap(vllm_config):
            # The block pool and the workers' views cover the reservation (the
            # cap); the workers commit what warmup measured, and a run-time
            # limit at it starts the engine (``_start_at_committed``).
            for config, blocks, tensors in planned:
                config.num_blocks, config.kv_cache_tensors = blocks, tensors
            vllm_config.cache_config.num_gpu_blocks = reserved
            _active.committed = num_blocks
            logger.info(
                "KV cache max memory: the block pool covers the cap's %d blocks; %d of them are committed (what "
                "fits after warmup), and a run-time limit can grow to the cap when the device has the memory.",
                reserved,
                num_blocks,
            )
            return reserved
        return num_blocks

    return finalize_extensible_kv_cache


def _reserve_for_cap(vllm_config: Any) -> bool:
    """Whether the workers can commit less than the block pool covers: a
    run-time limit returns and commits GPU memory on this engine."""
    from vllm_kv_cache_limit.hooks.runtime import availability, extensible_kv_cache

    try:
        availability.require_hooks()
    except KVCacheResizeError:
        return False
    return extensible_kv_cache.refusal(vllm_config) is None


def _log_decision(vllm_config: Any, decisions: list[CapDecision], configs: list[Any]) -> None:
    cap = decisions[0].cap
    budget = min(d.budget for d in decisions)
    num_blocks = min(c.num_blocks for c in configs)
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        tokens = get_kv_cache_capacity(vllm_config, configs[0])[0]
    except Exception:
        tokens = num_blocks * vllm_config.cache_config.block_size
    allocated = max(backing_bytes(c) for c in configs)
    logger.info(
        "KV cache max memory: %s = %d bytes (%s GiB) per device; vLLM budget "
        "%d bytes (%s GiB); cap %s; %d blocks, %d tokens. Allocating %d bytes "
        '(%s GiB) of KV cache per device; vLLM\'s "Available KV cache memory" '
        "above is its budget before the cap.",
        format_size(cap, "up"),
        cap,
        format_gib(cap),
        budget,
        format_gib(budget),
        _bound_text(vllm_config.cache_config, decisions),
        num_blocks,
        tokens,
        allocated,
        format_gib(allocated),
    )


def _name_cap_when_auto_fit_fails(original: Callable) -> Callable:
    """vLLM's ``--max-model-len auto`` fails telling the user to raise
    ``gpu_memory_utilization``; when the cap made the memory too small, name
    the cap."""
    return name_cap_when_refused(original, _auto_fit_message)


def _auto_fit_message(arguments: dict[str, Any]) -> str | None:
    decisions = _bound_decisions()
    return auto_fit_message(decisions[0].cap) if decisions else None


def _bound_decisions() -> list[CapDecision] | None:
    """The decisions of the ``get_kv_cache_configs`` call in progress, when the cap bound one."""
    decisions = getattr(_active, "decision", None)
    return decisions if decisions and any(d.bound for d in decisions) else None


def _bound_text(cache_config: Any, decisions: list[CapDecision]) -> str:
    if any(d.bound for d in decisions):
        return "bound (KV cache reduced to the cap)"
    if cache_config.kv_cache_memory_bytes is not None:
        return "not bound (--kv-cache-memory-bytes is smaller)"
    return f"not bound (vLLM's budget under --gpu-memory-utilization {compat.gpu_memory_utilization(cache_config)} is smaller)"


def _name_cap_when_too_small(original: Callable) -> Callable:
    """vLLM's check names ``gpu_memory_utilization``; when the cap made the
    memory too small, name the cap, reusing vLLM's estimates."""
    return name_cap_when_refused(original, _too_small_message)


def _too_small_message(arguments: dict[str, Any]) -> str | None:
    decisions = _bound_decisions()
    if not decisions:
        return None
    available_memory = arguments["available_memory"]
    # vLLM checks against the capped memory less the block it always
    # reserves (the null block); a cap must hold both.
    reserved = max(0, min(d.kv_bytes for d in decisions) - available_memory)
    needed = arguments["get_needed_memory"]()
    estimate = arguments["estimate_max_model_len"](available_memory) if available_memory > 0 else 0
    return too_small_message(decisions[0].cap, needed, reserved, arguments["max_model_len"], estimate)


GET_KV_CACHE_CONFIGS = Hook(
    ("vllm.v1.engine.core",),
    "get_kv_cache_configs",
    ("vllm_config", "kv_cache_specs", "available_memory"),
    wrapper=_cap_kv_cache_configs,
    upstream="none yet: `min(available_memory, kv_cache_max_memory)` in `get_kv_cache_configs`",
    remove_when="vLLM applies a KV cache cap itself",
)

CHECK_ENOUGH_KV_CACHE_MEMORY = Hook(
    ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
    "_check_enough_kv_cache_memory",
    ("available_memory", "get_needed_memory", "max_model_len", "estimate_max_model_len"),
    wrapper=_name_cap_when_too_small,
    upstream="none yet: vLLM's message naming the cap",
    remove_when="vLLM applies the cap (the message follows)",
)

AUTO_FIT_MAX_MODEL_LEN = Hook(
    ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
    "_auto_fit_max_model_len",
    wrapper=_name_cap_when_auto_fit_fails,
    upstream="none yet: vLLM's message naming the cap",
    remove_when="vLLM applies the cap (the message follows)",
)

ENGINE_CORE_INIT = Hook(
    ("vllm.v1.engine.core",),
    "EngineCore.__init__",
    ("self", "vllm_config"),
    wrapper=_hold_startup_lock,
    upstream="none yet: per-instance memory accounting instead of device-wide free-memory deltas "
    "(vllm #55827, #17979 describe the miscount; PR #18974 asks for several instances per GPU)",
    remove_when="vLLM measures only its own process's memory",
)

FINALIZE_EXTENSIBLE_KV_CACHE = Hook(
    ("vllm.v1.engine.core",),
    "finalize_extensible_kv_cache",
    ("vllm_config", "kv_cache_configs", "scheduler_kv_cache_config", "compilation_times"),
    versions=">=0.34",
    wrapper=_report_final_size,
    upstream="none yet: vLLM's log line and messages naming the cap",
    remove_when="vLLM applies the cap (its lines follow)",
)

HOOKS = (
    GET_KV_CACHE_CONFIGS,
    CHECK_ENOUGH_KV_CACHE_MEMORY,
    AUTO_FIT_MAX_MODEL_LEN,
    ENGINE_CORE_INIT,
    FINALIZE_EXTENSIBLE_KV_CACHE,
)

TARGETS = {"vllm.v1.engine.core": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
