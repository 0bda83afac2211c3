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
import atexit
import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat, envs, startup_lock
from vllm_kv_cache_limit.config import KVCacheLimitConfig
from vllm_kv_cache_limit.policy import (
    ENV_VAR,
    FLAG,
    CapDecision,
    KVCacheMaxMemoryError,
    auto_fit_message,
    cap_block_override,
    cap_error_message,
    cap_explicit_size,
    check_cap_fits_before_load,
    check_cap_within_instance,
    check_cap_within_total,
    check_explicit_size_within_free,
    kv_bytes_before_load,
    mamba_blocks_message,
    resolve_cap,
    too_small_message,
    utilization_ceiling,
)
from vllm_kv_cache_limit.sizes import format_gib, format_size, parse_size
from vllm_kv_cache_limit.weights import weight_bytes_lower_bound

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")

FIELD = "kv_cache_max_memory"
ERROR_RELAY_ENV = envs.ERROR_FILE
INACTIVE_WARNED_ENV = envs.INACTIVE_WARNED

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
    relay_cap_error(message)
    raise KVCacheMaxMemoryError(message)


def relay_cap_error(message: str) -> None:
    """Leave ``message`` for the first process, once: the first error written
    wins. The file lies in the first process's private folder and is created
    ``O_EXCL | O_NOFOLLOW``, so nothing planted there can redirect it."""
    path = os.environ.get(ERROR_RELAY_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w", encoding="utf-8") as relay:
        relay.write(message)


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
    field: dataclasses.Field[Any] = dataclasses.field(default=None)  # type: ignore[arg-type]
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
        group = next((g for g in parser._action_groups if g.title == "CacheConfig"), parser)
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
        _register_environment_variables()
        cap = resolve_cap(getattr(self, FIELD, None), os.environ.get(ENV_VAR))
        if cap is None:
            # No cap in force for the processes this engine starts.
            os.environ.pop(ERROR_RELAY_ENV, None)
            return original(self, *args, **kwargs)
        from vllm_kv_cache_limit import _bootstrap

        if _bootstrap.failed:
            raise KVCacheMaxMemoryError(_bootstrap.hook_failure_message(sorted(_bootstrap.failed.values())))
        total, device = _device_total_memory()
        check_cap_within_total(cap, total, device)
        problems = compat.check_hooks_at_startup()
        if problems:
            raise KVCacheMaxMemoryError(compat.drift_message(problems))
        startup_lock.lock_timeout()  # a bad value fails here, quoted
        config = original(self, *args, **kwargs)
        cache_config = config.cache_config
        setattr(cache_config, FIELD, cap)
        reduced, warning = cap_explicit_size(cache_config.kv_cache_memory_bytes, cap)
        if warning:
            logger.warning(warning)
            cache_config.kv_cache_memory_bytes = reduced
        _check_fits_before_load(config, cap)
        _arm_error_relay()
        return config

    return create_engine_config


def _register_environment_variables() -> None:
    """Why: vLLM checks every ``VLLM_*`` variable against its own table when
    it builds the engine config (``validate_environ``), and warns about, or
    with ``--fail-on-environ-validation`` refuses, the plugin's. How: adds
    the plugin's variables that are set to ``vllm.envs.environment_variables``
    before the original runs. Upstream: the variables in ``vllm.envs``."""
    import vllm.envs

    envs.register_with_vllm(vllm.envs.environment_variables)


@dataclasses.dataclass(frozen=True)
class _Device:
    key: str
    """Names the device in the lock folder: GPU UUID, or NUMA node."""
    label: str
    free: Callable[[], int]
    """Reads the device's free memory without initialising CUDA."""


def _instance_devices(vllm_config: Any, local_dp_rank: int | None = None) -> tuple[list[_Device], int]:
    """The devices one engine's local workers use, and how many workers share
    them (on the CPU backend every local worker uses the host's memory
    nodes). On a GPU: the GPUs vLLM gives the workers of local data-parallel
    rank ``local_dp_rank``, None: of this engine core's own rank, as its
    workers find it (see ``_local_gpu_ids``)."""
    from vllm.platforms import current_platform

    world = int(vllm_config.parallel_config.world_size)
    if current_platform.is_cpu():
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        nodes = sorted({cpu.numa_node for cpu in get_allowed_cpu_list()})
        return [
            _Device(
                f"cpu-node{node}",
                f"host memory node {node} (CPU backend)",
                functools.partial(lambda n: int(get_memory_node_info(n).available_memory), node),
            )
            for node in nodes
        ], world
    devices = []
    for physical in _local_gpu_ids(vllm_config.parallel_config, local_dp_rank):
        try:
            key = _nvml_uuid(physical)
        except Exception:
            key = f"{current_platform.device_type}{physical}"
        devices.append(_Device(key, f"GPU {physical} ({key})", functools.partial(_nvml_free, physical)))
    return devices, len(devices)


def _local_gpu_ids(parallel_config: Any, local_dp_rank: int | None) -> list[int]:
    """The physical (NVML) indices of the GPUs of one engine's local workers,
    by vLLM's own mapping: ``get_physical_gpu_ids_for_local_dp_rank`` (0.29
    v1/engine/utils.py:341-386, 0.33 v1/engine/utils.py:439-484; vLLM shards a
    rank's devices with it, honouring CUDA_VISIBLE_DEVICES and --device-ids)
    at the rank the workers offset their device by (``_dp_device_rank``).
    Local indices 0..world-1 would name rank 0's GPUs in every rank: on CUDA
    vLLM does not narrow CUDA_VISIBLE_DEVICES per rank, neither in the first
    process nor in the engine cores (``CoreEngineProcManager`` sets a rank's
    devices only on platforms other than CUDA and XPU, or with Ray: 0.29
    v1/engine/utils.py:208-220, 0.33 v1/engine/utils.py:307-320); each worker
    adds the offset in ``Worker.init_device``."""
    from vllm.platforms import current_platform
    from vllm.v1.engine.utils import get_physical_gpu_ids_for_local_dp_rank

    ids = get_physical_gpu_ids_for_local_dp_rank(
        current_platform.device_control_env_var,
        _dp_device_rank(parallel_config, local_dp_rank),
        int(parallel_config.world_size),
        int(parallel_config.local_world_size),
        user_assigned_gpu_ids=parallel_config.assigned_physical_gpu_ids,
    )
    return [int(i) for i in ids]


def _dp_device_rank(parallel_config: Any, local_dp_rank: int | None) -> int:
    """The local data-parallel rank by which vLLM's GPU worker offsets its
    device (local rank + rank x world size), or 0 where it adds none (a Ray
    or external-launcher backend, a replica spanning nodes). None: this
    engine's own rank, as the worker takes it (``data_parallel_rank_local``,
    which ``run_engine_core`` sets to the local rank, 0.29 core.py:1303-1305,
    0.33 core.py:1476-1478, and keeps when a dense model's rank runs as an
    independent engine, ``reconfigure_for_independent_dp_rank``; else
    ``data_parallel_index``). The same reading as vLLM's, which has no
    function for it before 0.33: ``Worker.init_device`` in 0.29-0.32 (0.29
    gpu_worker.py:353-370), ``ParallelConfig.get_local_gpu_index`` in 0.33
    (config/parallel.py:842-856, from gpu_worker.py:454); the plugin does not
    call the latter, so that one reading serves every supported release."""
    if (
        parallel_config.distributed_executor_backend in ("ray", "external_launcher")
        or parallel_config.data_parallel_backend == "ray"
        or parallel_config.nnodes_within_dp != 1
    ):
        return 0
    if local_dp_rank is None:
        local_dp_rank = parallel_config.data_parallel_rank_local
    if local_dp_rank is None:
        local_dp_rank = parallel_config.data_parallel_index
    return int(local_dp_rank)


def _launched_local_dp_ranks(parallel_config: Any) -> range:
    """The local data-parallel ranks whose engine cores the first process
    starts: ``data_parallel_size_local`` of them from ``data_parallel_rank_local``
    (unset: 0), as ``launch_core_engines`` hands them to
    ``CoreEngineProcManager`` (0.29 v1/engine/utils.py:1114-1115, 1228-1230
    and 184; 0.33 v1/engine/utils.py:1215-1216, 1374-1376 and 281)."""
    start = int(parallel_config.data_parallel_rank_local or 0)
    return range(start, start + int(parallel_config.data_parallel_size_local))


def _nvml_uuid(physical: int) -> str:
    """The UUID of the GPU at NVML index ``physical`` (no CUDA context)."""
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(physical))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        pynvml.nvmlShutdown()


def _nvml_free(physical: int) -> int:
    """Free memory of the GPU at NVML index ``physical`` (no CUDA context)."""
    from vllm.utils.import_utils import import_pynvml

    pynvml = import_pynvml()
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(physical)).free)
    finally:
        pynvml.nvmlShutdown()


def _check_fits_before_load(config: Any, cap: int) -> None:
    """Fail fast, in the first process and before any weights load, when the
    local workers' KV caches (the cap, or the explicit size under it; see
    ``policy.kv_bytes_before_load``) plus their share of the weights (read from the
    safetensors headers) exceed the free memory of their devices. Any reading
    that fails skips the check: it only refuses what cannot possibly fit.

    With data parallelism, each local rank this launch starts is checked on
    its own GPUs (each rank loads the whole model over its own workers): a
    user of ``--data-parallel-size 2`` expects the launch to stop at once when
    either rank cannot fit, naming that rank's GPUs. Ranks that name the same
    devices (the CPU backend's nodes) are checked once, not summed, so the
    check stays a lower bound."""
    try:
        parallel_config = config.parallel_config
        ranks = []
        seen = set()
        for rank in _launched_local_dp_ranks(parallel_config):
            devices, workers = _instance_devices(config, rank)
            keys = tuple(d.key for d in devices)
            if devices and workers > 0 and keys not in seen:
                seen.add(keys)
                ranks.append((rank, devices, workers, sum(device.free() for device in devices)))
        if not ranks:
            return
        model_config = config.model_config
        weights = 0
        if model_config.quantization is None:
            folder = _local_model_folder(model_config)
            itemsize = getattr(model_config.dtype, "itemsize", None)
            weights = weight_bytes_lower_bound(folder, itemsize) if folder else 0
        world = max(1, int(parallel_config.world_size))
    except Exception as exc:  # never refuse a start because a reading failed
        logger.debug("KV cache cap: fit check before loading skipped: %r", exc)
        return
    cache_config = config.cache_config
    kv_bytes = kv_bytes_before_load(cap, cache_config.kv_cache_memory_bytes, cache_config.num_gpu_blocks_override)
    for rank, devices, workers, free in ranks:
        label = " + ".join(d.label for d in devices)
        if len(ranks) > 1:
            label += f" of local data-parallel rank {rank}"
        check_cap_fits_before_load(cap, weights * workers // world, workers, free, label, kv_bytes)


def _local_model_folder(model_config: Any) -> str | None:
    """The model's folder on disk: the path given, or the Hugging Face cache
    snapshot when the model is already there (never downloads)."""
    model = str(model_config.model)
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model,
            revision=model_config.revision,
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception:
        return None


_relay_dir: str | None = None


def _arm_error_relay() -> None:
    """Name the relay file for the processes this engine starts: in a folder
    private to this process (``mkdtemp``, mode 0700), removed at exit."""
    global _relay_dir
    if _relay_dir is None or not os.path.isdir(_relay_dir):
        _relay_dir = tempfile.mkdtemp(prefix="vllm-kv-cache-limit-")
        atexit.register(shutil.rmtree, _relay_dir, True)
    path = os.path.join(_relay_dir, "cap-error")
    with contextlib.suppress(FileNotFoundError):
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
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8") as relay:
        message = relay.read()
    with contextlib.suppress(OSError):
        os.unlink(path)
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
    from vllm_kv_cache_limit import _resize_hooks

    _resize_hooks.add_engine_core_methods(module)
    if not (
        _hook_ok("get_kv_cache_configs")
        and _hook_ok("_check_enough_kv_cache_memory")
        and _hook_ok("EngineCore.__init__")
    ):
        return
    _wrap(module.EngineCore, "__init__", _hold_startup_lock)
    _wrap(module, "get_kv_cache_configs", _cap_kv_cache_configs)
    planner, _ = compat.resolve_hook(compat.get_hook("_check_enough_kv_cache_memory"))
    planner_module = __import__(planner.__module__, fromlist=["_"])
    _wrap(planner_module, "_check_enough_kv_cache_memory", _name_cap_when_too_small)
    if _hook_ok("_auto_fit_max_model_len"):
        _wrap(planner_module, "_auto_fit_max_model_len", _name_cap_when_auto_fit_fails)


def _hold_startup_lock(original: Callable) -> Callable:
    """Why: instances that measure memory at the same time count each other's
    memory (see ``startup_lock``). How: with a cap, ``EngineCore.__init__``
    (which starts the workers, profiles, allocates the KV cache and warms up,
    capturing CUDA graphs) runs holding the start-up lock of every local
    device; a cap error it fails with (also one a Ray worker on another node
    raised) goes to the relay for the first process. Upstream: none yet;
    vLLM measures device-wide free memory."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if cap_of(vllm_config.cache_config) is None:
            return original(self, vllm_config, *args, **kwargs)
        try:
            if not startup_lock.enabled():
                return original(self, vllm_config, *args, **kwargs)
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
                return original(self, vllm_config, *args, **kwargs)
            try:
                devices, _ = _instance_devices(vllm_config)
            except Exception as exc:
                logger.warning("No KV cache start-up lock: the devices could not be named (%r).", exc)
                devices = []
            with startup_lock.acquire([(d.key, d.label) for d in devices]):
                return original(self, vllm_config, *args, **kwargs)
        except Exception as exc:
            # A worker on another node (Ray) cannot reach the relay file; its
            # error reaches this process inside the executor's exception.
            message = cap_error_message(exc)
            if message:
                relay_cap_error(message)
            raise

    return __init__


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
    # vLLM 0.32/0.33: every KVCacheTensor of a worker names the same backing
    # allocation (``allocate_kv_cache``), of ``size`` bytes.
    allocated = max((int(t.size) for c in configs for t in c.kv_cache_tensors), default=0)
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
    the cap. Upstream: a message naming the cap."""

    def _auto_fit_max_model_len(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except ValueError:
            decisions = getattr(_active, "decision", None)
            if not decisions or not any(d.bound for d in decisions):
                raise
            _raise_cap_error(auto_fit_message(decisions[0].cap))

    return _auto_fit_max_model_len


def _bound_text(cache_config: Any, decisions: list[CapDecision]) -> str:
    if any(d.bound for d in decisions):
        return "bound (KV cache reduced to the cap)"
    if cache_config.kv_cache_memory_bytes is not None:
        return "not bound (--kv-cache-memory-bytes is smaller)"
    return f"not bound (vLLM's budget under --gpu-memory-utilization {cache_config.gpu_memory_utilization} is smaller)"


def _name_cap_when_too_small(original: Callable) -> Callable:
    """vLLM's check names ``gpu_memory_utilization``; when the cap made the
    memory too small, name the cap, reusing vLLM's estimates."""

    def _check_enough_kv_cache_memory(
        available_memory: int,
        get_needed_memory: Callable[[], int],
        max_model_len: int,
        estimate_max_model_len: Callable[[int], int],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
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
            _raise_cap_error(too_small_message(decisions[0].cap, needed, reserved, max_model_len, estimate))

    return _check_enough_kv_cache_memory


# ---------------------------------------------------------------------------
# Workers: the utilization as a ceiling, and the cap against what this
# instance can get
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Gate:
    """What vLLM's start-up gate asked for in this worker process."""

    device: str
    total: int
    free: int
    """Free memory at the first snapshot."""
    requested: int
    """What the worker finally requested (vLLM's budget before non-KV memory)."""
    limited_by_free: bool
    """Whether free memory, not ``--gpu-memory-utilization``, set ``requested``."""


def _gate_of(cache_config: Any) -> _Gate | None:
    """The start-up gate of the worker whose ``cache_config`` this is (set
    there by its gate hook; a later engine has a config of its own)."""
    return getattr(cache_config, "_kvcl_gate", None)


CPU_GATE_SLACK_FRACTION = 0.01
"""On the CPU backend vLLM reads free memory again after our reading; ask for
1% (at least 16 MiB) less than what was free so that a few pages moving in
between do not fail its gate."""


def _cpu_gate_slack(free: int) -> int:
    return max(16 * 2**20, int(free * CPU_GATE_SLACK_FRACTION))


def _log_gate(gate: _Gate, utilization: float) -> None:
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


def patch_gpu_worker(module: Any) -> None:
    """Why: vLLM refuses to start unless ``gpu_memory_utilization`` x total is
    free (``request_memory``), whatever the cap; and a cap above what the
    device can still give this instance would silently not bind.
    How: wraps the ``request_memory`` the GPU worker imported (with a cap,
    the utilization becomes min(itself, free/total)), and
    ``Worker.determine_available_memory`` (after vLLM's own profiling, the
    cap against the budget when free memory set it; an explicit size against
    the free memory first). Upstream: a per-instance memory limit in
    ``request_memory``; the free-memory checks where vLLM profiles."""
    if not _hook_ok("request_memory") or not hasattr(module, "request_memory"):
        if os.environ.get(ERROR_RELAY_ENV):
            _raise_cap_error(compat.drift_message(["vllm.v1.worker.gpu_worker.request_memory is missing"]))
        return
    _wrap(module, "request_memory", _ceiling_request_memory)
    if _hook_ok("Worker.determine_available_memory") and _hook_ok("get_world_group"):
        _wrap(
            module.Worker, "determine_available_memory", functools.partial(_check_cap_fits_instance, _cuda_free_memory)
        )


def _ceiling_request_memory(original: Callable) -> Callable:
    # vLLM 0.29-0.31: request_memory(init_snapshot, cache_config); 0.32+ adds
    # external_weight_memory. The arguments are passed on as received.
    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        cap = cap_of(cache_config)
        if cap is None:
            return original(init_snapshot, cache_config, *args, **kwargs)
        external = int(args[0] if args else kwargs.get("external_weight_memory", 0))
        total, free = int(init_snapshot.total_memory), int(init_snapshot.free_memory)
        utilization = cache_config.gpu_memory_utilization
        ceiling = utilization_ceiling(total, free, utilization, external)
        device = str(init_snapshot.device_)  # compat.ATTRIBUTES
        if ceiling:
            lowered = copy.copy(cache_config)
            lowered.gpu_memory_utilization = ceiling
            requested = original(init_snapshot, lowered, *args, **kwargs)
        else:
            requested = original(init_snapshot, cache_config, *args, **kwargs)
        # On the worker's own cache_config, which its determine_available_memory reads.
        cache_config._kvcl_gate = gate = _Gate(device, total, free, int(requested), bool(ceiling))
        _log_gate(gate, utilization)
        return requested

    return request_memory


def patch_cpu_worker(module: Any) -> None:
    """As ``patch_gpu_worker``, for vLLM's CPU worker, whose two gates are in
    ``CPUWorker.__init__`` (``gpu_memory_utilization`` x the node's memory
    must be available) and at the start of
    ``CPUWorker.determine_available_memory`` (that request less the
    worker's resident memory must still be available). How: with a cap,
    ``__init__`` runs with the utilization lowered to what is available, and
    ``requested_cpu_memory`` is lowered likewise before the second gate."""
    if not (
        _hook_ok("CPUWorker.__init__")
        and _hook_ok("CPUWorker.determine_available_memory")
        and _hook_ok("get_memory_node_info")
        and _hook_ok("get_world_group")
    ):
        return
    _wrap(module.CPUWorker, "__init__", _ceiling_cpu_worker_init)
    _wrap(module.CPUWorker, "determine_available_memory", functools.partial(_check_cap_fits_instance, _cpu_free_memory))


def _ceiling_cpu_worker_init(original: Callable) -> Callable:
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        cache_config = vllm_config.cache_config
        if cap_of(cache_config) is None or cache_config.kv_cache_memory_bytes is not None:
            # No cap, or an explicit size: vLLM skips the gate itself.
            return original(self, vllm_config, *args, **kwargs)
        # The node vLLM's gate in __init__ reads (self has no config yet).
        free, total, device = _cpu_node_memory(_cpu_memory_node(vllm_config.parallel_config))
        utilization = cache_config.gpu_memory_utilization
        ceiling = utilization_ceiling(total, free, utilization, slack=_cpu_gate_slack(free))
        if ceiling:
            cache_config.gpu_memory_utilization = ceiling
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            cache_config.gpu_memory_utilization = utilization
        cache_config._kvcl_gate = gate = _Gate(device, total, free, int(self.requested_cpu_memory), bool(ceiling))
        _log_gate(gate, utilization)
        return None

    return __init__


def _lower_cpu_request(worker: Any) -> None:
    """The CPU worker's second gate, as a ceiling: what it requested, at most
    its resident memory plus what is available now (less the slack)."""
    import psutil
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    gate = _gate_of(worker.cache_config)
    if gate is None:
        return
    requested = worker.requested_cpu_memory  # compat.ATTRIBUTES
    # vLLM's second gate reads the first allowed CPU's node (0.29
    # cpu_worker.py:203-206, 0.33 cpu_worker.py:195-198): the memory node,
    # except where that is not a visible memory node. The first gate's
    # request already keeps to the memory node; this only lowers it.
    free, _, _ = _cpu_node_memory(int(get_allowed_cpu_list()[0].numa_node))
    rss = psutil.Process().memory_info().rss
    ceiling = rss + free - _cpu_gate_slack(free)
    if ceiling < requested:
        worker.requested_cpu_memory = max(ceiling, 0)
        gate.requested = worker.requested_cpu_memory
        gate.limited_by_free = True
        gate.free = min(gate.free, free)


def _cuda_free_memory(worker: Any) -> tuple[int, int, str]:
    import torch

    # Memory torch caches but does not use is free for the KV cache.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total), f"cuda:{torch.cuda.current_device()}"


def _cpu_free_memory(worker: Any) -> tuple[int, int, str]:
    """Available and total memory of the NUMA node the CPU worker's memory
    (its KV cache too) comes from, and the node's name."""
    return _cpu_node_memory(_cpu_memory_node(worker.parallel_config))


def _cpu_node_memory(node: int) -> tuple[int, int, str]:
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    status = get_memory_node_info(node)
    return int(status.available_memory), int(status.total_memory), f"host memory node {node} (CPU backend)"


def _cpu_memory_node(parallel_config: Any) -> int:
    """The NUMA node a CPU worker's memory comes from, as vLLM's
    ``CPUWorker.__init__`` picks it, binds the worker's memory to
    (``init_cpu_memory_env``) and, in 0.29-0.32, reads at its first gate (0.29
    cpu_worker.py:45-95; 0.33 cpu_worker.py:48-78, no gate): the node of the first CPU
    this process may run on or, where that is not a visible memory node
    (CPU_VISIBLE_MEMORY_NODES; on 0.33 also this data-parallel rank's
    ``assigned_physical_gpu_ids``), the first visible one. In the worker the
    allowed CPUs are already the worker's own, before ``__init__``: the
    multiproc executor starts it, with the ``spawn`` method vLLM sets for
    the CPU backend (0.29 platforms/cpu.py:347, 0.33 platforms/cpu.py:426), in
    the OpenMP environment of its CPU list (``configure_omp_envs``, 0.29
    v1/executor/multiproc_executor.py:188-192 and utils/ompmultiprocessing.py:71-121;
    0.33 203-207 and 72-121), which the OpenMP runtime applies to the main
    thread as torch loads."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node

    node = int(get_allowed_cpu_list()[0].numa_node)
    if inspect.signature(get_visible_memory_node).parameters:  # vLLM >= 0.33
        visible = get_visible_memory_node(parallel_config.assigned_physical_gpu_ids)
    else:
        visible = get_visible_memory_node()
    return node if node in visible or not visible else int(visible[0])


def _check_cap_fits_instance(read_free: Callable[[Any], tuple[int, int, str]], original: Callable) -> Callable:
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        cap = cap_of(self.cache_config)
        if cap is None:
            return original(self, *args, **kwargs)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            # vLLM allocates exactly this much without measuring.
            free, total, device = read_free(self)
            _decide_together(lambda: check_explicit_size_within_free(min(explicit, cap), cap, free, total, device))
            _record_worker_cap(self, int(explicit), cap)
            return original(self, *args, **kwargs)
        if read_free is _cpu_free_memory:
            _lower_cpu_request(self)

        def profile_and_check() -> Any:
            # vLLM's own profiling runs inside the shared decision too, so a
            # rank where it raises still tells the others.
            budget = original(self, *args, **kwargs)
            _record_worker_cap(self, int(budget), cap)
            gate = _gate_of(self.cache_config)
            if gate is not None and gate.limited_by_free:
                check_cap_within_instance(cap, int(budget), gate.free, gate.requested - int(budget), gate.device)
            return budget

        return _decide_together(profile_and_check)

    return determine_available_memory


def _record_worker_cap(worker: Any, budget: int, cap: int) -> None:
    """Keep the cap and this worker's budget on the compilation config of
    the worker's engine: its model runner calls that config's
    ``resolve_cudagraph_mode_and_sizes`` once the KV cache is sized, and an
    engine built later in the same process has a config of its own."""
    worker.vllm_config.compilation_config._kvcl_cap_decision = CapDecision(budget=budget, cap=cap)


def cap_decision_of(compilation_config: Any) -> CapDecision | None:
    """The cap decision of the worker whose engine this compilation config
    belongs to (None: no cap in force there)."""
    return getattr(compilation_config, "_kvcl_cap_decision", None)


def _decide_together(step: Callable[[], Any]) -> Any:
    """Run ``step`` (a cap check, possibly with vLLM's profiling) on every
    rank and share the outcome, so that every rank raises the same cap error
    or none does, and a rank where vLLM itself failed does not leave the
    others waiting. A rank that raised alone would leave the others waiting
    forever in the next collective (the executor reads replies rank by rank
    with no timeout)."""
    outcome: tuple[str, str] | None = None
    failure: Exception | None = None
    result = None
    try:
        result = step()
    except KVCacheMaxMemoryError as exc:
        outcome, failure = ("cap", str(exc)), exc
    except Exception as exc:
        outcome, failure = ("other", f"{type(exc).__name__}: {exc}"), exc
    found = _first_failure_of_all_ranks(outcome)
    if found is None:
        return result
    rank, (kind, message) = found
    if kind == "cap":
        _raise_cap_error(message if outcome == (kind, message) else f"{message} (found by worker rank {rank})")
    if failure is not None:
        raise failure
    raise RuntimeError(f"worker rank {rank} failed while sizing the KV cache: {message}")


def _first_failure_of_all_ranks(outcome: tuple[str, str] | None) -> tuple[int, tuple[str, str]] | None:
    """All ranks of this engine exchange their outcome (None when fine) over
    vLLM's CPU world group; returns the same (rank, outcome) on every rank:
    the lowest rank's cap error, else the lowest rank's other failure."""
    import torch.distributed as dist

    gathered: list[tuple[str, str] | None] = [outcome]
    if dist.is_initialized():
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        if group.world_size > 1:
            gathered = [None] * group.world_size
            dist.all_gather_object(gathered, outcome, group=group.cpu_group)
    for kind in ("cap", "other"):
        for rank, found in enumerate(gathered):
            if found is not None and found[0] == kind:
                return rank, (found[0], found[1])
    return None


# ---------------------------------------------------------------------------
# vllm.config.compilation: hybrid (Mamba) models with full CUDA graphs
# ---------------------------------------------------------------------------


def patch_compilation_config(module: Any) -> None:
    """Why: with full CUDA graphs, vLLM needs a KV cache block per decoding
    sequence of a hybrid (Mamba) model and otherwise tells the user to raise
    ``gpu_memory_utilization``; under a binding cap that advice is wrong.
    How: wraps ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` (run in
    each worker once the KV cache is sized); when it refuses and the cap
    made the block count too small, raises an error naming the cap.
    Upstream: a message naming the cap."""
    if _hook_ok("CompilationConfig.resolve_cudagraph_mode_and_sizes"):
        _wrap(module.CompilationConfig, "resolve_cudagraph_mode_and_sizes", _name_cap_when_mamba_blocks_short)


def _name_cap_when_mamba_blocks_short(original: Callable) -> Callable:
    import inspect

    signature = inspect.signature(original)

    def resolve_cudagraph_mode_and_sizes(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except ValueError:
            decision = cap_decision_of(self)
            bound = signature.bind(self, *args, **kwargs).arguments
            kv_cache_config, max_num_reqs = bound.get("kv_cache_config"), bound.get("max_num_reqs")
            if (
                decision is None
                or not decision.bound
                or kv_cache_config is None
                or max_num_reqs is None
                or not kv_cache_config.has_mamba_layers
                or max_num_reqs <= kv_cache_config.num_blocks
            ):
                raise
            backing = max((int(t.size) for t in kv_cache_config.kv_cache_tensors), default=0)
            block_bytes = -(-backing // max(1, kv_cache_config.num_blocks))
            _raise_cap_error(mamba_blocks_message(decision.cap, kv_cache_config.num_blocks, max_num_reqs, block_bytes))

    return resolve_cudagraph_mode_and_sizes


# ---------------------------------------------------------------------------
# Run-time resize: optional hooks, in _resize_hooks (never stop start-up)
# ---------------------------------------------------------------------------


def patch_block_pool(module: Any) -> None:
    """See ``_resize_hooks.patch_block_pool``."""
    from vllm_kv_cache_limit import _resize_hooks

    _resize_hooks.patch_block_pool(module)


def patch_worker_base(module: Any) -> None:
    """See ``_resize_hooks.add_worker_method``."""
    from vllm_kv_cache_limit import _resize_hooks

    _resize_hooks.add_worker_method(module)


def patch_server_arg_parser(module: Any) -> None:
    """See ``_resize_hooks.patch_server_arg_parser``."""
    from vllm_kv_cache_limit import _resize_hooks

    _resize_hooks.patch_server_arg_parser(module)


def patch_server_app(module: Any) -> None:
    """See ``_resize_hooks.patch_build_app``."""
    from vllm_kv_cache_limit import _resize_hooks

    _resize_hooks.patch_build_app(module)
