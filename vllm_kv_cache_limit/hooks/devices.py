"""The devices an instance's workers use, read without initialising CUDA
(NVML on CUDA, the NUMA nodes on the CPU backend), and the fit check
before any weights load.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.logic.cap_decision import (
    check_cap_fits_before_load,
    kv_bytes_before_load,
)
from vllm_kv_cache_limit.logic.weights import weight_bytes_lower_bound

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def device_total_memory() -> tuple[int, str]:
    """Total memory of device 0, read without initialising CUDA (NVML on
    CUDA; system memory of the first NUMA node on the CPU backend)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return get_memory_node_info(0).total_memory, "host (CPU backend)"
    return int(current_platform.get_device_total_memory(0)), f"{current_platform.device_type}:0"


@dataclasses.dataclass(frozen=True)
class _Device:
    key: str
    """Names the device in the lock folder: GPU UUID, or NUMA node."""
    label: str
    free: Callable[[], int]
    """Reads the device's free memory without initialising CUDA."""


def instance_devices(vllm_config: Any, local_dp_rank: int | None = None) -> tuple[list[_Device], int]:
    """The devices one engine's local workers use, and how many workers share
    them (on the CPU backend every local worker uses the host's memory
    nodes). On a GPU: the GPUs vLLM gives the workers of local data-parallel
    rank ``local_dp_rank``, None: of this engine core's own rank, as its
    workers find it (see ``_local_gpu_ids``)."""
    from vllm.platforms import current_platform

    world = int(vllm_config.parallel_config.world_size)
    if current_platform.is_cpu():
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

        nodes = sorted({cpu.numa_node for cpu in get_allowed_cpu_list()})
        return [
            _Device(
                f"cpu-node{node}",
                f"host memory node {node} (CPU backend)",
                functools.partial(lambda n: cpu_node_memory(n)[0], node),
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
    by vLLM's own mapping: ``get_physical_gpu_ids_for_local_dp_rank``
    (``vllm/v1/engine/utils.py``; vLLM shards a
    rank's devices with it, honouring CUDA_VISIBLE_DEVICES and --device-ids)
    at the rank the workers offset their device by (``_dp_device_rank``).
    Local indices 0..world-1 would name rank 0's GPUs in every rank: on CUDA
    vLLM does not narrow CUDA_VISIBLE_DEVICES per rank, neither in the first
    process nor in the engine cores (``CoreEngineProcManager`` sets a rank's
    devices only on platforms other than CUDA and XPU, or with Ray); each worker
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
    which ``run_engine_core`` sets to the local rank, and keeps when a dense model's rank runs as an
    independent engine, ``reconfigure_for_independent_dp_rank``; else
    ``data_parallel_index``). The same reading as vLLM's, which has no
    function for it before 0.33: ``Worker.init_device`` in 0.29-0.32,
    ``ParallelConfig.get_local_gpu_index`` from 0.33; the plugin does not
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
    ``CoreEngineProcManager``."""
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


def check_fits_before_load(config: Any, cap: int) -> None:
    """Fail fast, in the first process and before any weights load, when the
    local workers' KV caches (the cap, or the explicit size under it; see
    ``policy.kv_bytes_before_load``) plus their share of the weights (read from the
    safetensors headers) exceed the free memory of their devices by more than
    ``policy.CAP_TOLERANCE`` of what the weights leave (none for an explicit
    size). Any reading that fails skips the check: it only refuses what
    cannot possibly fit.

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
            devices, workers = instance_devices(config, rank)
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
    explicit = cache_config.kv_cache_memory_bytes is not None  # allocated whole: no tolerance
    for rank, devices, workers, free in ranks:
        label = " + ".join(d.label for d in devices)
        if len(ranks) > 1:
            label += f" of local data-parallel rank {rank}"
        check_cap_fits_before_load(cap, weights * workers // world, workers, free, label, kv_bytes, explicit)


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


def cuda_free_memory(worker: Any) -> tuple[int, int, str]:
    import torch

    # Memory torch caches but does not use is free for the KV cache.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total), f"cuda:{torch.cuda.current_device()}"


def cpu_free_memory(worker: Any) -> tuple[int, int, str]:
    """Available and total memory of the NUMA node the CPU worker's memory
    (its KV cache too) comes from, and the node's name."""
    return cpu_node_memory(cpu_memory_node(worker.parallel_config))


def cpu_node_memory(node: int) -> tuple[int, int, str]:
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    status = get_memory_node_info(node)
    return int(status.available_memory), int(status.total_memory), f"host memory node {node} (CPU backend)"


def cpu_memory_node(parallel_config: Any) -> int:
    """The NUMA node a CPU worker's memory comes from, as vLLM's
    ``CPUWorker.__init__`` picks it, binds the worker's memory to
    (``init_cpu_memory_env``) and, in 0.29-0.32, reads at its first gate (0.33 has
    no such gate): the node of the first CPU
    this process may run on or, where that is not a visible memory node
    (CPU_VISIBLE_MEMORY_NODES; on 0.33 also this data-parallel rank's
    ``assigned_physical_gpu_ids``), the first visible one. In the worker the
    allowed CPUs are already the worker's own, before ``__init__``: the
    multiproc executor starts it, with the ``spawn`` method vLLM sets for
    the CPU backend (``vllm/platforms/cpu.py``), in
    the OpenMP environment of its CPU list (``configure_omp_envs``), which the OpenMP runtime applies to the main
    thread as torch loads."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node

    node = int(get_allowed_cpu_list()[0].numa_node)
    if inspect.signature(get_visible_memory_node).parameters:  # vLLM >= 0.33
        visible = get_visible_memory_node(parallel_config.assigned_physical_gpu_ids)
    else:
        visible = get_visible_memory_node()
    return node if node in visible or not visible else int(visible[0])


GET_MEMORY_NODE_INFO = Hook(("vllm.utils.cpu_resource_utils",), "get_memory_node_info")

GET_ALLOWED_CPU_LIST = Hook(("vllm.utils.cpu_resource_utils",), "get_allowed_cpu_list")

GET_VISIBLE_MEMORY_NODE = Hook(("vllm.utils.cpu_resource_utils",), "get_visible_memory_node")

GET_PHYSICAL_GPU_IDS_FOR_LOCAL_DP_RANK = Hook(
    ("vllm.v1.engine.utils",),
    "get_physical_gpu_ids_for_local_dp_rank",
    ("device_control_env_var", "local_dp_rank", "world_size", "local_world_size", "user_assigned_gpu_ids"),
)

# Called, not wrapped: which device a worker's cap is for, and its size.
PLATFORM_IS_CPU = Hook(("vllm.platforms.interface",), "Platform.is_cpu", ("self",))
# A classmethod: its first parameter reads as ``cls`` in vLLM's source and not
# on the class, so only its presence is checked.
PLATFORM_GET_DEVICE_TOTAL_MEMORY = Hook(("vllm.platforms.interface",), "Platform.get_device_total_memory")

HOOKS = (
    GET_MEMORY_NODE_INFO,
    GET_ALLOWED_CPU_LIST,
    GET_VISIBLE_MEMORY_NODE,
    GET_PHYSICAL_GPU_IDS_FOR_LOCAL_DP_RANK,
    PLATFORM_IS_CPU,
    PLATFORM_GET_DEVICE_TOTAL_MEMORY,
)
"""Called, not wrapped."""

TARGETS: dict[str, Callable[[Any], None]] = {}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
