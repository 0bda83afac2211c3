"""Every place where vllm-kv-cache-limit hooks into vLLM.

Each hook is a small named function that wraps vLLM's own function and
adjusts its arguments or result; no vLLM code is copied. ``_bootstrap`` runs
``patch_<module>`` right after the vLLM module loads. For each hook the
comment says why it is needed, what it wraps, and what change in vLLM would
make it unnecessary. ``compat.HOOKS`` lists the same places, with the
parameters relied on, for the start-up and CI checks.

The decisions themselves (sizes, budget vs cap, messages) are plain
functions in ``sizes`` and ``policy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.config import KVCacheLimitConfig
from vllm_kv_cache_limit.policy import (
    ENV_VAR,
    FLAG,
    CapDecision,
    KVCacheMaxMemoryError,
    cap_block_override,
    cap_explicit_size,
    check_cap_within_free,
    check_cap_within_total,
    resolve_cap,
    too_small_message,
)
from vllm_kv_cache_limit.sizes import format_gib, format_size, parse_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

FIELD = "kv_cache_max_memory"
ERROR_RELAY_ENV = "VLLM_KV_CACHE_LIMIT_ERROR_FILE"
"""Set in the first process when a cap is given; an engine-core or worker
process writes its cap error there so that the first process can raise it
as the final error instead of vLLM's generic "Engine core initialization
failed"."""

INACTIVE_WARNED_ENV = "VLLM_KV_CACHE_LIMIT_INACTIVE_WARNED"
"""Set once the "plugin is inactive" warning was logged in this process
tree."""

_WRAPPED = "__vllm_kv_cache_limit_wrapped__"
_inactive_warned = False


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable], static: bool = False) -> None:
    """Replace ``owner.name`` by ``make(original)``, once."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    if isinstance(original, staticmethod):
        original = original.__func__
    if getattr(original, _WRAPPED, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _WRAPPED, True)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def _hook_ok(qualname: str) -> bool:
    """Check one hook against the imported vLLM; warn once when it does not
    fit, and tell the caller to leave vLLM untouched."""
    global _inactive_warned
    _, problem = compat.resolve_hook(compat.get_hook(qualname))
    if problem is None:
        return True
    if os.environ.get(ERROR_RELAY_ENV):
        # An engine-core or worker process of an engine started with a cap:
        # never leave the cap silently unenforced.
        _raise_cap_error(compat.drift_message([problem]))
    if not _inactive_warned and not os.environ.get(INACTIVE_WARNED_ENV):
        _inactive_warned = True
        # Engine-core and worker processes inherit this and stay quiet: one
        # warning per launch, from the process the user started.
        os.environ[INACTIVE_WARNED_ENV] = "1"
        logger.warning(
            "vllm-kv-cache-limit is inactive: %s (installed vLLM %s; supported: %s). "
            "vLLM runs unchanged; %s would fail.",
            problem,
            compat.installed_vllm_version(),
            compat.SUPPORTED_VLLM[1],
            FLAG,
        )
    return False


def cap_of(cache_config: Any) -> int | None:
    """The cap carried on vLLM's CacheConfig, in bytes (None: no cap)."""
    return getattr(cache_config, FIELD, None)


def _raise_cap_error(message: str) -> None:
    """Raise a cap error; from an engine-core or worker process, also hand
    the message to the first process (see ``patch_engine_startup``)."""
    path = os.environ.get(ERROR_RELAY_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as relay:
                relay.write(message)
        except OSError:
            pass
    raise KVCacheMaxMemoryError(message)


# ---------------------------------------------------------------------------
# vllm.engine.arg_utils: the engine argument and the CLI flag
# ---------------------------------------------------------------------------


def patch_engine_args(module: Any) -> None:
    """Add ``kv_cache_max_memory`` to ``EngineArgs`` (and its subclasses such
    as ``AsyncEngineArgs``), to the CLI, and to the engine config."""
    engine_args = module.EngineArgs
    if not _hook_ok("EngineArgs.__init__"):
        return
    for cls in _with_subclasses(engine_args):
        # Dataclass subclasses have their own generated __init__ and fields.
        if "__init__" in cls.__dict__ and "__dataclass_fields__" in cls.__dict__:
            add_engine_args_field(cls)
    if _hook_ok("EngineArgs.add_cli_args"):
        _wrap(engine_args, "add_cli_args", _add_cli_flag, static=True)
    if _hook_ok("EngineArgs.create_engine_config"):
        _wrap(engine_args, "create_engine_config", _carry_cap_into_config)


def _with_subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(current.__subclasses__())
    return found


def add_engine_args_field(cls: type) -> None:
    """Why: ``LLM(model, kv_cache_max_memory=...)`` passes its keywords to
    ``EngineArgs(**kwargs)``, ``from_cli_args`` copies the dataclass fields
    from the parsed CLI, and ``vllm bench`` rebuilds ``LLM`` from
    ``dataclasses.asdict(engine_args)``; all need a real dataclass field.
    How: registers the field on the existing class and wraps its generated
    ``__init__`` to accept, validate and store the keyword.
    Upstream: an ``EngineArgs.kv_cache_max_memory`` field."""
    if FIELD in cls.__dict__.get("__dataclass_fields__", {}):
        return
    field = dataclasses.field(default=None)
    field.name = FIELD
    field.type = "str | int | None"
    field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    cls.__dataclass_fields__[FIELD] = field  # type: ignore[attr-defined]
    setattr(cls, FIELD, None)

    def make(original_init: Callable) -> Callable:
        def __init__(self: Any, *args: Any, kv_cache_max_memory: str | int | None = None, **kwargs: Any) -> None:
            if kv_cache_max_memory is not None:
                kv_cache_max_memory = parse_size(kv_cache_max_memory)
            self.kv_cache_max_memory = kv_cache_max_memory
            original_init(self, *args, **kwargs)

        return __init__

    _wrap(cls, "__init__", make)


def cli_size(value: str) -> int:
    """argparse ``type`` for ``--kv-cache-max-memory``: argparse prints an
    ``ArgumentTypeError``'s message (a ``ValueError``'s it would hide)."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _flag_help() -> str:
    # The help is the field's docstring, read as vLLM reads its config fields.
    from vllm.config.utils import get_attr_docs

    # argparse expands %-formats in help texts.
    return get_attr_docs(KVCacheLimitConfig)[FIELD].replace("%", "%%")


def _add_cli_flag(original: Callable) -> Callable:
    """Why: every entry point that builds engine arguments (serve, the
    api_server module, bench, run-batch) calls ``EngineArgs.add_cli_args``.
    How: after the original, adds ``--kv-cache-max-memory`` to its
    ``CacheConfig`` group. Upstream: a field on ``CacheConfig``."""

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        if any(FLAG in action.option_strings for action in parser._actions):
            return parser
        group = next(
            (g for g in parser._action_groups if g.title == "CacheConfig"), parser
        )
        group.add_argument(
            FLAG,
            dest=FIELD,
            type=cli_size,
            default=None,
            metavar="SIZE",
            help=_flag_help(),
        )
        return parser

    return add_cli_args


def _device_total_memory() -> tuple[int, str]:
    """Total memory of device 0, read without initialising CUDA (NVML on
    CUDA; system memory of the first NUMA node on the CPU backend)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return get_memory_node_info(0).total_memory, "host (CPU backend)"
    return int(current_platform.get_device_total_memory(0)), f"{current_platform.device_type}:0"


def _carry_cap_into_config(original: Callable) -> Callable:
    """Why: the cap must reach the engine core and every worker.
    How: resolves the cap (argument, else ``VLLM_KV_CACHE_MAX_MEMORY``),
    refuses one above the device's total memory before anything loads, calls
    the original, then sets ``cache_config.kv_cache_max_memory`` (pickled to
    every process; shown by ``CacheConfig.metrics_info``) and reduces an
    explicit ``kv_cache_memory_bytes`` above the cap.
    Upstream: ``CacheConfig.kv_cache_max_memory`` and the same checks in
    ``VllmConfig.__post_init__``."""

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        cap = resolve_cap(getattr(self, FIELD, None), os.environ.get(ENV_VAR))
        if cap is None:
            # No cap in force for the processes this engine starts.
            os.environ.pop(ERROR_RELAY_ENV, None)
            return original(self, *args, **kwargs)
        total, device = _device_total_memory()
        check_cap_within_total(cap, total, device)
        problems = compat.check_hooks_at_startup()
        if problems:
            raise KVCacheMaxMemoryError(compat.drift_message(problems))
        config = original(self, *args, **kwargs)
        cache_config = config.cache_config
        setattr(cache_config, FIELD, cap)
        reduced, warning = cap_explicit_size(cache_config.kv_cache_memory_bytes, cap)
        if warning:
            logger.warning(warning)
            cache_config.kv_cache_memory_bytes = reduced
        _arm_error_relay()
        return config

    return create_engine_config


def _arm_error_relay() -> None:
    path = os.path.join(tempfile.gettempdir(), f"vllm-kv-cache-limit-{os.getpid()}.err")
    if os.path.exists(path):
        os.unlink(path)
    os.environ[ERROR_RELAY_ENV] = path


# ---------------------------------------------------------------------------
# vllm.v1.engine.utils: the cap error as the final error of the first process
# ---------------------------------------------------------------------------


def patch_engine_startup(module: Any) -> None:
    """Why: an error raised in the engine-core process reaches the first
    process only as "Engine core initialization failed. See root cause
    above." How: wraps ``wait_for_engine_startup``; when it fails and an
    engine-core or worker process left a cap error in the relay file, that
    error is raised instead. Upstream: the engine core sending its startup
    exception to the client (the handshake already carries a status)."""
    if _hook_ok("wait_for_engine_startup"):
        _wrap(module, "wait_for_engine_startup", _raise_relayed_error)


def _raise_relayed_error(original: Callable) -> Callable:
    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError as exc:
            message = take_relayed_error()
            if message:
                raise KVCacheMaxMemoryError(message) from exc
            raise

    return wait_for_engine_startup


def take_relayed_error() -> str | None:
    """Read and remove the cap error left by a child process, if any."""
    path = os.environ.get(ERROR_RELAY_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as relay:
            message = relay.read()
        os.unlink(path)
    except OSError:
        return None
    return message or None


# ---------------------------------------------------------------------------
# vllm.v1.engine.core: the block count
# ---------------------------------------------------------------------------

_active = threading.local()


def patch_engine_core(module: Any) -> None:
    """Why: the engine core turns each worker's KV budget into the number of
    blocks in ``get_kv_cache_configs``; the cap belongs there.
    How: wraps the engine core's ``get_kv_cache_configs`` and, in the module
    that defines it, ``_check_enough_kv_cache_memory`` (for an error that
    names the cap). Upstream: ``min(available_memory, kv_cache_max_memory)``
    in ``get_kv_cache_configs``."""
    if not (_hook_ok("get_kv_cache_configs") and _hook_ok("_check_enough_kv_cache_memory")):
        return
    _wrap(module, "get_kv_cache_configs", _cap_kv_cache_configs)
    planner, _ = compat.resolve_hook(compat.get_hook("_check_enough_kv_cache_memory"))
    planner_module = __import__(planner.__module__, fromlist=["_"])  # type: ignore[union-attr]
    _wrap(planner_module, "_check_enough_kv_cache_memory", _name_cap_when_too_small)


def _cap_kv_cache_configs(original: Callable) -> Callable:
    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: Any, available_memory: list[int], *args: Any, **kwargs: Any) -> Any:
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
                reduced, warning = cap_block_override(
                    override, min(c.num_blocks for c in fit), cap
                )
                if warning:
                    logger.warning(warning)
                    cache_config.num_gpu_blocks_override = reduced
            configs = original(vllm_config, kv_cache_specs, capped, *args, **kwargs)
        finally:
            _active.decision = None
        _log_decision(vllm_config, decisions, configs)
        return configs

    return get_kv_cache_configs


def _log_decision(vllm_config: Any, decisions: list[CapDecision], configs: list[Any]) -> None:
    cap = decisions[0].cap
    budget = min(d.budget for d in decisions)
    num_blocks = min(c.num_blocks for c in configs)
    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

        tokens = get_kv_cache_capacity(vllm_config, configs[0])[0]
    except Exception:
        tokens = num_blocks * vllm_config.cache_config.block_size
    logger.info(
        "KV cache max memory: %s = %d bytes (%s GiB) per device; vLLM budget "
        "%d bytes (%s GiB); cap %s; %d blocks, %d tokens.",
        format_size(cap, "up"),
        cap,
        format_gib(cap),
        budget,
        format_gib(budget),
        "bound (KV cache reduced to the cap)" if any(d.bound for d in decisions) else "not bound",
        num_blocks,
        tokens,
    )


def _name_cap_when_too_small(original: Callable) -> Callable:
    """vLLM's check names ``gpu_memory_utilization``; when the cap made the
    memory too small, name the cap, reusing vLLM's estimates."""

    def _check_enough_kv_cache_memory(available_memory: int, get_needed_memory: Callable[[], int], max_model_len: int, estimate_max_model_len: Callable[[int], int], *args: Any, **kwargs: Any) -> Any:
        try:
            return original(available_memory, get_needed_memory, max_model_len, estimate_max_model_len, *args, **kwargs)
        except ValueError:
            decisions = getattr(_active, "decision", None)
            if not decisions or not any(d.bound for d in decisions):
                raise
            # vLLM checks against the capped memory less the block it always
            # reserves (the null block); a cap must hold both.
            reserved = max(0, min(d.kv_bytes for d in decisions) - available_memory)
            needed = get_needed_memory()
            estimate = estimate_max_model_len(available_memory) if available_memory > 0 else 0
            _raise_cap_error(
                too_small_message(decisions[0].cap, needed, reserved, max_model_len, estimate)
            )

    return _check_enough_kv_cache_memory


# ---------------------------------------------------------------------------
# Workers: the cap against the device's free memory
# ---------------------------------------------------------------------------


def patch_gpu_worker(module: Any) -> None:
    """Why: a cap above the free memory would let start-up pass and fail
    later. How: wraps ``Worker.determine_available_memory`` (weights are
    loaded, no KV cache allocated yet) to read ``torch.cuda.mem_get_info()``
    first. Upstream: the same check where vLLM takes its memory snapshot."""
    if _hook_ok("Worker.determine_available_memory"):
        _wrap(module.Worker, "determine_available_memory", functools.partial(_check_free_memory, _cuda_free_memory))


def patch_cpu_worker(module: Any) -> None:
    """As ``patch_gpu_worker``, for ``CPUWorker.determine_available_memory``,
    reading the available host memory that vLLM's CPU worker itself reads."""
    if _hook_ok("CPUWorker.determine_available_memory") and _hook_ok("get_memory_node_info"):
        _wrap(module.CPUWorker, "determine_available_memory", functools.partial(_check_free_memory, _cpu_free_memory))


def _cuda_free_memory(worker: Any) -> tuple[int, int, str]:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(free), int(total), f"cuda:{torch.cuda.current_device()}"


def _cpu_free_memory(worker: Any) -> tuple[int, int, str]:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    node = get_allowed_cpu_list()[0].numa_node
    status = get_memory_node_info(node)
    return int(status.available_memory), int(status.total_memory), f"host memory node {node} (CPU backend)"


def _check_free_memory(read_free: Callable[[Any], tuple[int, int, str]], original: Callable) -> Callable:
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        cap = cap_of(self.cache_config)
        if cap is not None:
            free, total, device = read_free(self)
            try:
                check_cap_within_free(cap, free, total, device)
            except KVCacheMaxMemoryError as exc:
                _raise_cap_error(str(exc))
        return original(self, *args, **kwargs)

    return determine_available_memory
