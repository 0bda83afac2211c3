"""The vLLM glue without an engine: the engine argument, the CLI flag, the
start-up hook, and the CUDA validation path with torch.cuda mocked."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from argparse import ArgumentError
from pathlib import Path
from types import SimpleNamespace

import pytest

# The submodules this file reaches as hooks.cap.X, imported here rather than
# left to the vLLM imports of whichever test ran first.
import vllm_kv_cache_limit.hooks.cap.cpu_worker
import vllm_kv_cache_limit.hooks.cap.engine_core
import vllm_kv_cache_limit.hooks.cap.gpu_worker
import vllm_kv_cache_limit.hooks.cap.worker_gate  # noqa: F401
from vllm_kv_cache_limit import _bootstrap, hooks, register
from vllm_kv_cache_limit.config import FIELD
from vllm_kv_cache_limit.hooks.worker_state import Gate, WorkerState
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

GiB = 2**30
MiB = 2**20
# EngineArgs resolves the model path offline; any local folder will do here.
LOCAL_MODEL = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def vllm_modules():
    register()
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs, AsyncEngineArgs, FlexibleArgumentParser


def test_register_is_idempotent() -> None:
    import vllm.engine.arg_utils as arg_utils

    register()
    register()
    _bootstrap.install()
    init = arg_utils.EngineArgs.__init__
    create = arg_utils.EngineArgs.create_engine_config
    _bootstrap.install()
    assert arg_utils.EngineArgs.__init__ is init
    assert arg_utils.EngineArgs.create_engine_config is create
    assert sum(isinstance(f, _bootstrap._PostImportFinder) for f in sys.meta_path) == 1


def test_engine_args_field(vllm_modules) -> None:
    EngineArgs, AsyncEngineArgs, _ = vllm_modules
    for cls in (EngineArgs, AsyncEngineArgs):
        assert "kv_cache_max_memory" in [f.name for f in dataclasses.fields(cls)]
        args = cls(model=LOCAL_MODEL, kv_cache_max_memory="1.5GiB")
        assert args.kv_cache_max_memory == int(1.5 * GiB)
        assert dataclasses.asdict(args)["kv_cache_max_memory"] == int(1.5 * GiB)
        assert cls(model=LOCAL_MODEL).kv_cache_max_memory is None


def test_engine_args_refuse_bad_value_quoting_it(vllm_modules) -> None:
    EngineArgs, _, _ = vllm_modules
    with pytest.raises(ValueError, match=r"Invalid size '8 gigs'"):
        EngineArgs(model=LOCAL_MODEL, kv_cache_max_memory="8 gigs")


def _parser(vllm_modules):
    EngineArgs, _, FlexibleArgumentParser = vllm_modules
    return EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))


@pytest.mark.parametrize(
    ("value", "expected"), [("8G", 8 * GiB), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * GiB)), ("1000", 1000)]
)
def test_cli_flag_parses(vllm_modules, value: str, expected: int) -> None:
    EngineArgs, _, _ = vllm_modules
    args = _parser(vllm_modules).parse_args(["--model", LOCAL_MODEL, "--kv-cache-max-memory", value])
    assert args.kv_cache_max_memory == expected
    assert EngineArgs.from_cli_args(args).kv_cache_max_memory == expected


def test_cli_flag_default_is_none(vllm_modules) -> None:
    assert _parser(vllm_modules).parse_args([]).kv_cache_max_memory is None


@pytest.mark.parametrize("value", ["8X", "0", "-1G", "1e9", "nan"])
def test_cli_flag_refuses_bad_values(vllm_modules, value: str) -> None:
    with pytest.raises(ArgumentError) as info:
        _parser(vllm_modules).parse_args([f"--kv-cache-max-memory={value}"])
    assert repr(value) in str(info.value)


def test_cli_flag_is_in_cache_config_group_with_help(vllm_modules) -> None:
    parser = _parser(vllm_modules)
    group = next(g for g in parser._action_groups if g.title == "CacheConfig")
    action = next(a for a in group._group_actions if "--kv-cache-max-memory" in a.option_strings)
    for text in (
        "upper bound",
        "per device",
        "smaller of vLLM's own budget",
        "--gpu-memory-utilization",
        "--kv-cache-memory-bytes",
        "--num-gpu-blocks-override",
        "8G",
        "512MiB",
        "1.5GiB",
    ):
        assert text.lower() in " ".join(action.help.split()).lower(), text


def test_help_topic_shows_the_flag() -> None:
    code = (
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "p = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "import sys; p.parse_args(sys.argv[1:])\n"
    )
    for topic in ("--help=kv-cache-max-memory", "--help=CacheConfig"):
        out = subprocess.run([sys.executable, "-c", code, topic], capture_output=True, text=True, timeout=120)
        assert "--kv-cache-max-memory" in out.stdout, out.stdout + out.stderr
        assert "upper bound" in out.stdout.lower()


# --- CUDA path: no GPU here, so torch.cuda and NVML are mocked -------------


def _cache_config(utilization: float, cap: int | None):
    """vLLM's own CacheConfig, carrying the cap as the engine config does."""
    from vllm.config import CacheConfig

    config = CacheConfig(gpu_memory_utilization=utilization)
    config.kv_cache_max_memory = cap
    return config


def _snapshot(total: int, free: int):
    return SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0")


def test_cuda_gate_refuses_without_cap_and_asks_for_free_memory_with_one() -> None:
    """vLLM's own ``request_memory`` (the function vLLM 0.33's GPU worker
    calls in ``init_device``), wrapped as the plugin wraps it."""
    from vllm.v1.worker.utils import request_memory

    wrapped = hooks.cap.gpu_worker._ceiling_request_memory(request_memory)
    snapshot = _snapshot(80 * GiB, 20 * GiB)  # another instance holds 60 GiB
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        wrapped(snapshot, _cache_config(0.9, None))  # the premise: vLLM alone refuses
    config = _cache_config(0.9, 8 * GiB)
    requested = wrapped(snapshot, config)
    assert 20 * GiB - 1 <= requested <= 20 * GiB
    assert config.gpu_memory_utilization == 0.9  # the caller's config is untouched
    gate = WorkerState.peek(config).gate  # kept on the worker's own config
    assert gate is not None and gate.limited_by_free and gate.free == 20 * GiB
    # Weights held by another process (external_weight_memory) count as vLLM counts them.
    with pytest.raises(ValueError, match="engine's budget after excluding"):
        wrapped(snapshot, _cache_config(0.9, None), 10 * GiB)
    assert 20 * GiB - 1 <= wrapped(snapshot, _cache_config(0.9, 8 * GiB), 10 * GiB) <= 20 * GiB


def test_cuda_gate_with_the_two_argument_request_memory_of_vllm_0_29_to_0_31() -> None:
    """vLLM 0.29-0.31 call ``request_memory(init_snapshot, cache_config)``,
    with no ``external_weight_memory``: the wrapper passes on only what it got."""
    from vllm.v1.worker.utils import request_memory

    def request_memory_0_31(init_snapshot, cache_config):  # the older signature
        return request_memory(init_snapshot, cache_config)

    wrapped = hooks.cap.gpu_worker._ceiling_request_memory(request_memory_0_31)
    snapshot = _snapshot(80 * GiB, 20 * GiB)
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        wrapped(snapshot, _cache_config(0.9, None))
    config = _cache_config(0.9, 8 * GiB)
    assert 20 * GiB - 1 <= wrapped(snapshot, config) <= 20 * GiB
    assert WorkerState.peek(config).gate.limited_by_free


@pytest.mark.parametrize(("utilization", "free"), [(0.9, 79 * GiB), (0.3, 30 * GiB)])
def test_cuda_gate_unchanged_when_the_utilization_is_free(utilization: float, free: int) -> None:
    from vllm.v1.worker.utils import request_memory

    snapshot = _snapshot(80 * GiB, free)
    expected = request_memory(snapshot, _cache_config(utilization, None))
    config = _cache_config(utilization, 8 * GiB)
    assert hooks.cap.gpu_worker._ceiling_request_memory(request_memory)(snapshot, config) == expected
    assert not WorkerState.peek(config).gate.limited_by_free


def _gpu_worker(cap: int | None, explicit: int | None = None, gate=None):
    """A GPU worker as the hooks see it; ``gate``: what its start-up gate left."""
    cache_config = SimpleNamespace(kv_cache_max_memory=cap, kv_cache_memory_bytes=explicit)
    if gate is not None:
        WorkerState.of(cache_config).gate = gate
    vllm_config = SimpleNamespace(cache_config=cache_config, compilation_config=SimpleNamespace())
    return SimpleNamespace(cache_config=cache_config, vllm_config=vllm_config)


def _gate(*, free: int, requested: int, limited: bool):
    return Gate("cuda:0", 80 * GiB, free, requested, limited)


def test_cuda_cap_above_what_the_instance_can_get_fails_after_profiling(mocker) -> None:
    gate = _gate(free=20 * GiB, requested=20 * GiB, limited=True)
    original = mocker.Mock(return_value=6 * GiB)  # vLLM's budget after profiling
    wrapped = hooks.cap.worker_gate.check_cap_fits_instance(hooks.devices.cuda_free_memory, original)
    with pytest.raises(KVCacheMaxMemoryError) as info:
        wrapped(_gpu_worker(8 * GiB, gate=gate))
    message = str(info.value)
    assert "can still give this instance" in message and "needs 14.00 GiB" in message
    assert "--kv-cache-max-memory 6GiB" in message
    assert wrapped(_gpu_worker(6 * GiB, gate=gate)) == 6 * GiB


def test_cuda_cap_above_a_utilization_budget_is_not_an_error(mocker) -> None:
    gate = _gate(free=70 * GiB, requested=24 * GiB, limited=False)  # --gpu-memory-utilization 0.3
    original = mocker.Mock(return_value=10 * GiB)
    mem_get_info = mocker.patch("torch.cuda.mem_get_info")
    worker = _gpu_worker(40 * GiB, gate=gate)
    assert hooks.cap.worker_gate.check_cap_fits_instance(hooks.devices.cuda_free_memory, original)(worker) == 10 * GiB
    mem_get_info.assert_not_called()


def test_cuda_explicit_size_checked_against_free_memory_after_empty_cache(mocker) -> None:
    calls = []
    mocker.patch("torch.cuda.empty_cache", side_effect=lambda: calls.append("empty_cache"))
    mocker.patch("torch.cuda.mem_get_info", side_effect=lambda: calls.append("mem_get_info") or (10 * GiB, 80 * GiB))
    mocker.patch("torch.cuda.current_device", return_value=0)
    original = mocker.Mock(return_value=4 * GiB)
    wrapped = hooks.cap.worker_gate.check_cap_fits_instance(hooks.devices.cuda_free_memory, original)
    # --kv-cache-memory-bytes 4G --kv-cache-max-memory 130G: 4 GiB fits.
    assert wrapped(_gpu_worker(130 * GiB, 4 * GiB)) == 4 * GiB
    assert calls == ["empty_cache", "mem_get_info"]
    original.reset_mock()
    with pytest.raises(KVCacheMaxMemoryError) as info:  # no tolerance
        wrapped(_gpu_worker(10 * GiB + 1, 10 * GiB + 1))
    assert "10.00 GiB free of 80.00 GiB total" in str(info.value) and "cuda:0" in str(info.value)
    original.assert_not_called()  # vLLM never profiled nor allocated


def test_cuda_checks_skipped_without_cap(mocker) -> None:
    mem_get_info = mocker.patch("torch.cuda.mem_get_info")
    original = mocker.Mock(return_value=5)
    assert (
        hooks.cap.worker_gate.check_cap_fits_instance(hooks.devices.cuda_free_memory, original)(_gpu_worker(None)) == 5
    )
    mem_get_info.assert_not_called()


def _cuda_platform(mocker, count: int = 2):
    """``count`` GPUs, CUDA_VISIBLE_DEVICES unset, NVML mocked (see below)."""
    mocker.patch.dict(os.environ)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    _nvml(mocker)
    return _vllm_cuda_platform(mocker, count)


def _engine_config(model: str, world: int, quantization: str | None = None):
    import torch
    from vllm.config import ParallelConfig

    return SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=world),
        model_config=SimpleNamespace(model=model, dtype=torch.bfloat16, quantization=quantization, revision=None),
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None, num_gpu_blocks_override=None),
    )


def test_cuda_fail_fast_weights_plus_caps_against_nvml_free(mocker, tmp_path: Path) -> None:
    """Before any weights load, in the first process: NVML's free memory of
    each local GPU, no CUDA context."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1024, 1024, dtype=torch.float32)}, tmp_path / "model.safetensors")
    weights = 1024 * 1024 * 2  # loaded as bfloat16
    _cuda_platform(mocker)
    free = {0: 100 * MiB, 1: 100 * MiB}
    nvml = mocker.patch.object(hooks.devices, "_nvml_free", side_effect=lambda i: free[i])
    cuda_init = mocker.patch("torch.cuda.init")
    config = _engine_config(str(tmp_path), world=2)
    room = 200 * MiB - weights  # for the two KV caches
    hooks.devices.check_fits_before_load(config, room // 2)  # fits exactly
    hooks.devices.check_fits_before_load(config, (room + room // 100) // 2)  # 1% above: the tolerance
    with pytest.raises(KVCacheMaxMemoryError) as info:
        hooks.devices.check_fits_before_load(config, (room + room // 100) // 2 + 1)
    assert "GPU 0 (GPU-uuid-0) + GPU 1 (GPU-uuid-1)" in str(info.value)
    assert f"weights take at least 2MiB ({weights} bytes)" in str(info.value)
    assert sorted(c.args[0] for c in nvml.call_args_list) == [0, 0, 0, 1, 1, 1]  # each check reads both
    cuda_init.assert_not_called()
    # On-the-fly quantization may shrink the weights: only the caps count then.
    hooks.devices.check_fits_before_load(_engine_config(str(tmp_path), 2, "fp8"), 100 * MiB)
    # An explicit size under the cap is what will be allocated: a cap above
    # the free memory passes when the size fits, and the size is named.
    explicit = _engine_config(str(tmp_path), world=2)
    explicit.cache_config.kv_cache_memory_bytes = room // 2
    hooks.devices.check_fits_before_load(explicit, 10 * GiB)
    explicit.cache_config.kv_cache_memory_bytes += 1  # no tolerance: vLLM allocates all of it
    with pytest.raises(KVCacheMaxMemoryError, match=r"The KV cache of \d+ bytes .* set by --kv-cache-memory-bytes"):
        hooks.devices.check_fits_before_load(explicit, 10 * GiB)
    # Nor when the cap reduced the explicit size to itself.
    explicit.cache_config.kv_cache_memory_bytes = 10 * GiB
    hooks.devices.check_fits_before_load(explicit, room // 2)
    with pytest.raises(KVCacheMaxMemoryError, match=r"^--kv-cache-max-memory .* cannot fit"):
        hooks.devices.check_fits_before_load(explicit, room // 2 + 1)
    # A block count: a block's size is not known yet, only the weights count.
    blocks = _engine_config(str(tmp_path), world=2)
    blocks.cache_config.num_gpu_blocks_override = 10**6
    hooks.devices.check_fits_before_load(blocks, 10 * GiB)


def test_cuda_fail_fast_skipped_when_nvml_fails(mocker, tmp_path: Path) -> None:
    _cuda_platform(mocker)
    mocker.patch.object(hooks.devices, "_nvml_free", side_effect=RuntimeError("NVML Shared Library Not Found"))
    hooks.devices.check_fits_before_load(_engine_config(str(tmp_path), 1), 100 * GiB)  # no refusal


def test_startup_lock_names_each_local_gpu_by_uuid(mocker) -> None:
    _cuda_platform(mocker, count=4)
    from vllm.config import ParallelConfig

    devices, workers = hooks.devices.instance_devices(
        SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2))
    )
    assert [d.key for d in devices] == ["GPU-uuid-0", "GPU-uuid-1"] and workers == 2


# --- Data parallel: vLLM's own device mapping, device counts and NVML mocked --


def _nvml(mocker, free: dict[int, int] | None = None) -> None:
    """A stand-in for pynvml: the device at NVML index i has UUID GPU-uuid-i."""
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUUID=lambda handle: f"GPU-uuid-{handle}",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(free=(free or {}).get(handle, 80 * GiB)),
    )
    mocker.patch("vllm.utils.import_utils.import_pynvml", return_value=fake)


def _vllm_cuda_platform(mocker, count: int):
    """vLLM's ``Platform`` with CUDA's device-control variable, so that its own
    ``device_id_to_physical_device_id`` reads CUDA_VISIBLE_DEVICES; installed
    where the plugin and vLLM's ``get_physical_gpu_ids_for_local_dp_rank``
    look it up."""
    from vllm.platforms.interface import Platform, PlatformEnum

    class Cuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

        @classmethod
        def device_count(cls) -> int:
            return count

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            # As vLLM's NvmlCudaPlatform.get_device_uuid.
            from vllm.utils.import_utils import import_pynvml

            pynvml = import_pynvml()
            handle = pynvml.nvmlDeviceGetHandleByIndex(cls.device_id_to_physical_device_id(device_id))
            return str(pynvml.nvmlDeviceGetUUID(handle))

    platform = Cuda()
    mocker.patch("vllm.platforms.current_platform", platform)
    mocker.patch("vllm.v1.engine.utils.current_platform", platform)
    return platform


def _engine_core_parallel_config(tp: int, dp: int, local_dp_rank: int, **kwargs):
    """The parallel config of a dense model's engine core of local
    data-parallel rank ``local_dp_rank``, set as vLLM's
    ``EngineCoreProc.run_engine_core`` sets it (0.33 core.py:1476-1478,
    1545, 1554): its local rank kept, its data parallelism reduced to one."""
    from vllm.config import ParallelConfig

    config = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, data_parallel_size_local=dp, **kwargs)
    if dp > 1:
        config.data_parallel_rank_local = local_dp_rank
        config.data_parallel_index = local_dp_rank
        config.reconfigure_for_independent_dp_rank()
    return config


@pytest.mark.parametrize(
    ("visible", "count", "dp", "local_dp_rank", "kwargs", "expected"),
    [
        # CUDA_VISIBLE_DEVICES unset: rank 1's workers at local offset 1 x world size.
        (None, 4, 2, 1, {}, [2, 3]),
        # One CUDA_VISIBLE_DEVICES for the whole launch: offset within it.
        ("4,5,6,7", 4, 2, 1, {}, [6, 7]),
        # --device-ids 4,5,6,7: offset within them.
        (None, 8, 2, 1, {"assigned_physical_gpu_ids": [4, 5, 6, 7]}, [6, 7]),
        # Narrowed per rank (a server per rank): devices 0 and 1 of the visible ones.
        ("6,7", 2, 1, 0, {}, [6, 7]),
    ],
)
def test_engine_core_locks_the_gpus_of_its_data_parallel_rank(
    mocker, monkeypatch, visible: str | None, count: int, dp: int, local_dp_rank: int, kwargs: dict, expected: list
) -> None:
    """vLLM's GPU worker offsets its device by the local data-parallel rank x
    the world size (0.29 gpu_worker.py:353-370, 0.33 gpu_worker.py:454 and
    config/parallel.py:842-856); the engine core names the same GPUs."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    _vllm_cuda_platform(mocker, count)
    _nvml(mocker)
    config = SimpleNamespace(parallel_config=_engine_core_parallel_config(2, dp, local_dp_rank, **kwargs))
    devices, workers = hooks.devices.instance_devices(config)
    assert [d.key for d in devices] == [f"GPU-uuid-{i}" for i in expected] and workers == 2


def test_ray_data_parallel_engine_core_takes_the_gpus_vllm_assigned_it(mocker, monkeypatch) -> None:
    """With Ray data parallelism vLLM gives each engine-core actor its rank's
    GPUs in ``assigned_physical_gpu_ids`` (0.33 core.py:2707-2729, 2741-2775)
    and its workers add no offset (0.29 gpu_worker.py:353-358, 0.33
    config/parallel.py:846-850): rank 1 names GPUs 2 and 3, once."""
    from vllm.v1.engine.utils import get_physical_gpu_ids_for_local_dp_rank

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _vllm_cuda_platform(mocker, 4)
    _nvml(mocker)
    parallel_config = _engine_core_parallel_config(2, 2, 1, data_parallel_backend="ray")
    parallel_config.assigned_physical_gpu_ids = get_physical_gpu_ids_for_local_dp_rank("CUDA_VISIBLE_DEVICES", 1, 2)
    devices, workers = hooks.devices.instance_devices(SimpleNamespace(parallel_config=parallel_config))
    assert [d.key for d in devices] == ["GPU-uuid-2", "GPU-uuid-3"] and workers == 2


def test_fail_fast_checks_each_local_data_parallel_rank_on_its_own_gpus(mocker, monkeypatch, tmp_path: Path) -> None:
    """In the first process, ``vllm serve --data-parallel-size 2
    --tensor-parallel-size 2`` starts local ranks 0 and 1 (0.33
    v1/engine/utils.py:1215-1216, 1374-1376; CoreEngineProcManager 281):
    rank 1 loads onto GPUs 2 and 3, and GPU 3 has too little free."""
    import torch
    from safetensors.torch import save_file
    from vllm.config import ParallelConfig

    save_file({"w": torch.zeros(1024, 1024, dtype=torch.float32)}, tmp_path / "model.safetensors")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _vllm_cuda_platform(mocker, 4)
    _nvml(mocker, {0: 40 * GiB, 1: 40 * GiB, 2: 40 * GiB, 3: 10 * GiB})
    config = SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_size_local=2),
        model_config=SimpleNamespace(model=str(tmp_path), dtype=torch.bfloat16, quantization=None, revision=None),
        cache_config=SimpleNamespace(kv_cache_memory_bytes=None, num_gpu_blocks_override=None),
    )
    hooks.devices.check_fits_before_load(config, 24 * GiB)  # 2 x 24 GiB + weights fit in 50 GiB
    with pytest.raises(KVCacheMaxMemoryError) as info:
        hooks.devices.check_fits_before_load(config, 26 * GiB)  # 4% above: beyond the 1% tolerance
    message = str(info.value)
    assert "GPU 2 (GPU-uuid-2) + GPU 3 (GPU-uuid-3) of local data-parallel rank 1" in message, message
    assert "--kv-cache-max-memory 24.99GiB" in message, message


def test_cpu_gate_reads_the_memory_node_vllm_binds_the_worker_to(mocker, monkeypatch) -> None:
    """vLLM's own ``CPUWorker.__init__``, run here: it takes the worker's memory
    from the first allowed CPU's node, or, when that node is not a visible
    memory node, from the first visible one, and gates on that node (0.29
    cpu_worker.py:45-95; 0.33 picks the node alike, cpu_worker.py:48-78).
    Here the CPUs start on node 0 but the memory is node 1's: the ceiling
    must come from node 1's free memory."""
    import torch
    from vllm.config import CompilationConfig, ParallelConfig
    from vllm.utils import cpu_resource_utils
    from vllm.utils.cpu_resource_utils import LogicalCPUInfo, MemoryNodeInfo
    from vllm.v1.worker import cpu_worker, gpu_worker

    cpus = [LogicalCPUInfo(id=0, physical_core=0, numa_node=0), LogicalCPUInfo(id=1, physical_core=1, numa_node=1)]
    nodes = {0: MemoryNodeInfo(8 * GiB, 1 * GiB), 1: MemoryNodeInfo(8 * GiB, 6 * GiB)}
    for module in (cpu_resource_utils, cpu_worker):
        mocker.patch.object(module, "get_allowed_cpu_list", return_value=cpus)
        mocker.patch.object(module, "get_memory_node_info", side_effect=nodes.__getitem__)
    mocker.patch.object(cpu_resource_utils, "get_memory_affinity", return_value=[0, 1])
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "1")
    bind = mocker.patch.object(torch.ops._C, "init_cpu_memory_env")
    mocker.patch.object(
        gpu_worker.Worker,
        "__init__",
        autospec=True,
        side_effect=lambda self, vllm_config, *args, **kwargs: setattr(
            self, "parallel_config", vllm_config.parallel_config
        ),
    )
    init = cpu_worker.CPUWorker.__init__
    original = getattr(init, "__wrapped__", init)
    parallel_config = ParallelConfig()

    def config(cap: int | None) -> SimpleNamespace:
        return SimpleNamespace(
            cache_config=_cache_config(0.9, cap),
            parallel_config=parallel_config,
            compilation_config=CompilationConfig(),
        )

    with pytest.raises(ValueError, match="less than desired CPU memory utilization"):
        original(object.__new__(cpu_worker.CPUWorker), config(None), 0, 0, "tcp://127.0.0.1:1")  # 7.2 > 6 GiB
    bind.assert_called_with([1])  # the premise: vLLM binds the worker's memory to node 1
    worker = object.__new__(cpu_worker.CPUWorker)
    capped = config(16 * MiB)
    hooks.cap.cpu_worker._ceiling_cpu_worker_init(original)(worker, capped, 0, 0, "tcp://127.0.0.1:1")
    slack = hooks.cap.worker_gate.cpu_gate_slack(6 * GiB)
    assert 6 * GiB - slack - MiB <= worker.requested_cpu_memory <= 6 * GiB - slack
    gate = WorkerState.peek(capped.cache_config).gate
    assert gate is not None and gate.device == "host memory node 1 (CPU backend)"
    assert hooks.devices.cpu_free_memory(worker) == (6 * GiB, 8 * GiB, "host memory node 1 (CPU backend)")


RSS = 1 * GiB
"""The CPU worker's resident memory (weights, runtime) in the tests below."""


def _profiled_cpu_worker(mocker, monkeypatch):
    """vLLM's own ``CPUWorker``, its ``__init__`` and
    ``determine_available_memory`` wrapped by the plugin's hooks, on a host
    whose one memory node has 6 of 8 GiB available (another process holds
    the rest) and a worker resident in 1 GiB: only those readings are faked.
    Returns the worker after ``__init__`` and its wrapped
    ``determine_available_memory``."""
    import torch
    from vllm.config import CompilationConfig, ParallelConfig
    from vllm.utils import cpu_resource_utils
    from vllm.utils.cpu_resource_utils import LogicalCPUInfo, MemoryNodeInfo
    from vllm.v1.worker import cpu_worker, gpu_worker

    cpus = [LogicalCPUInfo(id=0, physical_core=0, numa_node=0)]
    for module in (cpu_resource_utils, cpu_worker):
        mocker.patch.object(module, "get_allowed_cpu_list", return_value=cpus)
        mocker.patch.object(module, "get_memory_node_info", return_value=MemoryNodeInfo(8 * GiB, 6 * GiB))
    mocker.patch.object(cpu_resource_utils, "get_memory_affinity", return_value=[0])
    monkeypatch.setenv("CPU_VISIBLE_MEMORY_NODES", "0")
    mocker.patch.object(torch.ops._C, "init_cpu_memory_env")
    mocker.patch("psutil.Process", return_value=SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=RSS)))
    mocker.patch.object(hooks.cap.cpu_worker, "rss_bytes", return_value=RSS)

    def worker_init(self, vllm_config, *args, **kwargs) -> None:  # what WorkerBase.__init__ keeps
        self.vllm_config = vllm_config
        self.cache_config = vllm_config.cache_config
        self.parallel_config = vllm_config.parallel_config
        self.compilation_config = vllm_config.compilation_config

    mocker.patch.object(gpu_worker.Worker, "__init__", autospec=True, side_effect=worker_init)
    init = cpu_worker.CPUWorker.__init__
    determine = cpu_worker.CPUWorker.determine_available_memory
    config = SimpleNamespace(
        cache_config=_cache_config(0.9, 16 * MiB),
        parallel_config=ParallelConfig(),
        compilation_config=CompilationConfig(),
    )
    worker = object.__new__(cpu_worker.CPUWorker)
    hooks.cap.cpu_worker._ceiling_cpu_worker_init(getattr(init, "__wrapped__", init))(
        worker, config, 0, 0, "tcp://127.0.0.1:1"
    )
    worker.model_runner = SimpleNamespace(warming_up_model=lambda: None)  # its memory is in RSS
    return worker, hooks.cap.cpu_worker._check_cap_fits_cpu(getattr(determine, "__wrapped__", determine))


def test_cpu_cap_within_the_tolerance_above_the_budget_starts_with_the_budget(
    mocker, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cap 0.5% above what free memory leaves this instance after vLLM's
    profiling (rounding, drift between readings): accepted, the KV cache
    gets vLLM's budget, and one INFO line says so."""
    import logging

    worker, determine_available_memory = _profiled_cpu_worker(mocker, monkeypatch)
    assert WorkerState.peek(worker.cache_config).gate.limited_by_free  # the premise
    budget = worker.requested_cpu_memory - RSS  # what vLLM's profiling will leave
    cap = budget + budget // 200
    worker.cache_config.kv_cache_max_memory = cap
    with caplog.at_level(logging.INFO, logger="vllm.plugins.kv_cache_limit"):
        assert determine_available_memory(worker) == budget
    decision = WorkerState.peek(worker.vllm_config.compilation_config).cap_decision
    assert decision is not None and decision.kv_bytes == budget and not decision.bound
    records = [r for r in caplog.records if "tolerance" in r.getMessage()]
    assert [(r.name, r.levelno) for r in records] == [("vllm.plugins.kv_cache_limit", logging.INFO)], caplog.text
    lines = [r.getMessage() for r in records]
    assert f"({cap} bytes) is {cap - budget} bytes (0.50%) above" in lines[0], lines[0]
    assert "within the 1% tolerance" in lines[0] and f"the KV cache gets the budget, {budget} bytes" in lines[0]


def test_cpu_cap_beyond_the_tolerance_above_the_budget_is_refused(mocker, monkeypatch) -> None:
    """1.5% above the same budget: refused after profiling, naming the cap."""
    from vllm_kv_cache_limit.logic.sizes import format_size

    worker, determine_available_memory = _profiled_cpu_worker(mocker, monkeypatch)
    budget = worker.requested_cpu_memory - RSS
    cap = budget + budget * 15 // 1000
    worker.cache_config.kv_cache_max_memory = cap
    with pytest.raises(KVCacheMaxMemoryError) as info:
        determine_available_memory(worker)
    message = str(info.value)
    assert message.startswith(f"--kv-cache-max-memory {format_size(cap, 'up')} ({cap} bytes"), message
    assert "can still give this instance" in message and f"({budget} bytes) for the KV cache" in message
    assert WorkerState.peek(worker.vllm_config.compilation_config).cap_decision.budget == budget


@pytest.mark.parametrize(("data_parallel_size", "locked"), [(1, True), (2, False)])
def test_startup_lock_not_taken_by_coupled_data_parallel_ranks(mocker, data_parallel_size: int, locked: bool) -> None:
    """A dense model's data-parallel engine cores run with
    data_parallel_size 1 and take the lock; a mixture-of-experts model's keep
    their size, start in lockstep, and would deadlock on it."""
    from vllm_kv_cache_limit.logic import startup_lock

    acquire = mocker.patch.object(startup_lock, "acquire")
    mocker.patch.object(
        hooks.cap.engine_core,
        "instance_devices",
        return_value=([hooks.devices._Device("cpu-node0", "node 0", lambda: 0)], 1),
    )
    original = mocker.Mock()
    config = SimpleNamespace(
        cache_config=SimpleNamespace(**{FIELD: 16 * 2**20}),
        parallel_config=SimpleNamespace(data_parallel_size=data_parallel_size, data_parallel_rank=1),
    )
    hooks.cap.engine_core._hold_startup_lock(original)("engine", config)
    original.assert_called_once_with("engine", config)
    assert acquire.called is locked


def test_cuda_fail_fast_uses_nvml_total(mocker) -> None:
    """On CUDA the device total comes from the platform (NVML), not torch.cuda."""
    platform = mocker.Mock()
    platform.is_cpu.return_value = False
    platform.device_type = "cuda"
    platform.get_device_total_memory.return_value = 80 * GiB
    mocker.patch("vllm.platforms.current_platform", platform)
    cuda_init = mocker.patch("torch.cuda.init")
    assert hooks.devices.device_total_memory() == (80 * GiB, "cuda:0")
    platform.get_device_total_memory.assert_called_once_with(0)
    cuda_init.assert_not_called()


def _entry_point_parsers():
    """Every vLLM entry point that builds engine arguments, as vLLM builds its parser."""
    from vllm.benchmarks import latency, throughput
    from vllm.entrypoints.launchers import cli_args, run_batch
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def build(add):
        parser = FlexibleArgumentParser(exit_on_error=False)
        return add(parser) or parser

    return {
        "serve / api_server": build(cli_args.make_arg_parser),
        "run-batch": build(run_batch.make_arg_parser),
        "bench throughput": build(throughput.add_cli_args),
        "bench latency": build(latency.add_cli_args),
    }


def test_every_entry_point_accepts_the_flag(vllm_modules) -> None:
    for name, parser in _entry_point_parsers().items():
        actions = [a for a in parser._actions if "--kv-cache-max-memory" in a.option_strings]
        assert len(actions) == 1, name
        assert actions[0].type("1.5GiB") == int(1.5 * GiB), name


# --- fail closed ---------------------------------------------------------------

FAILING_HOOK = """
import sys
from vllm_kv_cache_limit.hooks.cap import engine_core

def broken(module):
    raise RuntimeError("simulated hook failure")

engine_core.patch = broken
try:
    import vllm.v1.engine.core
except Exception as exc:
    print("IMPORT_FAILED", type(exc).__name__, exc)
    sys.exit(0)
print("IMPORTED")
if len(sys.argv) > 1:
    from vllm.engine.arg_utils import EngineArgs
    try:
        EngineArgs(model=sys.argv[1], kv_cache_max_memory="16M").create_engine_config()
    except Exception as exc:
        print("CONFIG_FAILED", type(exc).__name__, exc)
"""


def _run_failing_hook(env_extra: dict[str, str], *args: str) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k not in (envs.MAX_MEMORY, envs.ERROR_FILE)}
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", FAILING_HOOK, *args], capture_output=True, text=True, env=env, timeout=300
    )
    return proc.stdout + proc.stderr


def test_hook_failure_under_a_cap_stops_naming_the_hook(tmp_path: Path) -> None:
    # An engine-core or worker process of a capped engine (the relay is armed).
    out = _run_failing_hook({envs.ERROR_FILE: str(tmp_path / "relay")})
    assert "IMPORT_FAILED UnsupportedVLLMError" in out, out
    assert "hooks.cap.engine_core:patch on vllm.v1.engine.core failed: RuntimeError('simulated hook failure')" in out
    assert "simulated hook failure" in (tmp_path / "relay").read_text()  # reaches the first process
    # The cap from the environment: the same.
    assert "IMPORT_FAILED UnsupportedVLLMError" in _run_failing_hook({"VLLM_KV_CACHE_MAX_MEMORY": "16M"})


def test_hook_failure_without_a_cap_warns_then_a_cap_stops_start_up(tiny_model: str) -> None:
    out = _run_failing_hook({}, tiny_model)
    assert "IMPORTED" in out, out
    assert "could not hook vllm.v1.engine.core" in out
    assert "CONFIG_FAILED UnsupportedVLLMError" in out, out
    assert "Missing or changed hooks or attributes: hooks.cap.engine_core:patch on vllm.v1.engine.core failed" in out


def test_bootstrap_module_map_comes_from_the_registry() -> None:
    """``_bootstrap`` keeps the registry's module map as text (interpreter
    start-up imports nothing): the two must agree, function for function."""
    from vllm_kv_cache_limit.compat import registry

    derived = {
        target: tuple(f"{f.__module__.removeprefix('vllm_kv_cache_limit.')}:{f.__name__}" for f in patches_)
        for target, patches_ in registry.targets().items()
    }
    assert derived == _bootstrap.HOOKED_MODULES


def test_no_hook_is_named_by_a_string() -> None:
    """Each hook is checked through its entry (``hook_ok(ENTRY)``,
    ``optional(ENTRY, ...)``), never looked up by its name."""
    import ast
    import inspect

    from vllm_kv_cache_limit.compat import registry

    for module in registry.modules(registry.CAP_MODULES + registry.RESIZE_MODULES):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hook_ok", "optional", "problem_of"):
                assert node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)), (module.__name__, node.lineno)


# --- hybrid (Mamba) models with full CUDA graphs, against vLLM's own check ----


def _resolve_full_cuda_graphs_for_16_sequences_in_10_mamba_blocks(config) -> None:
    """vLLM's check as a worker runs it once its KV cache is sized: a hybrid
    model's 10 blocks of 4 KiB, 16 sequences, full CUDA graphs (vLLM refuses)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    kv_cache_config = SimpleNamespace(
        has_mamba_layers=True, num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=10 * 4096)]
    )
    config.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport.ALWAYS, "test", kv_cache_config=kv_cache_config, max_num_reqs=16
    )


@pytest.mark.parametrize("decision", ["none", "not bound", "bound"])
def test_mamba_block_shortage_names_the_cap_when_it_binds(mocker, decision: str) -> None:
    from vllm.config.compilation import CompilationConfig

    from vllm_kv_cache_limit.logic.cap_decision import CapDecision

    register()
    cap = 40 * 1024
    worker_cap = {
        "none": None,
        "not bound": CapDecision(budget=cap // 2, cap=cap),
        "bound": CapDecision(budget=GiB, cap=cap),
    }[decision]
    config = CompilationConfig()
    if worker_cap is not None:  # as the worker's determine_available_memory leaves it
        worker = _gpu_worker(cap)
        worker.vllm_config.compilation_config = config
        hooks.cap.worker_gate.record_worker_cap(worker, **vars(worker_cap))
    with pytest.raises(ValueError) as info:
        _resolve_full_cuda_graphs_for_16_sequences_in_10_mamba_blocks(config)
    if decision != "bound":
        # vLLM's own refusal, unchanged.
        assert type(info.value) is ValueError and "increase gpu_memory_utilization" in str(info.value)
        return
    message = str(info.value)
    assert isinstance(info.value, KVCacheMaxMemoryError)
    assert message.startswith("--kv-cache-max-memory 40KiB (40960 bytes")
    assert "gives 10 KV cache blocks, fewer than max_num_seqs=16" in message
    assert "--max-num-seqs 10 or less" in message and "at least --kv-cache-max-memory 64KiB" in message
    assert "gpu_memory_utilization" not in message


def test_auto_fit_failure_names_the_cap_when_it_binds(mocker) -> None:
    from vllm_kv_cache_limit.logic.cap_decision import CapDecision

    def vllms_auto_fit(*args, **kwargs):
        raise ValueError(
            "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single "
            "token. Try increasing `gpu_memory_utilization`."
        )

    wrapped = hooks.cap.engine_core._name_cap_when_auto_fit_fails(vllms_auto_fit)
    mocker.patch.object(
        hooks.cap.engine_core._active, "decision", [CapDecision(budget=GiB, cap=64 * 1024)], create=True
    )
    with pytest.raises(KVCacheMaxMemoryError, match=r"64KiB .* too small for even one token with --max-model-len auto"):
        wrapped()
    mocker.patch.object(
        hooks.cap.engine_core._active, "decision", [CapDecision(budget=32 * 1024, cap=64 * 1024)], create=True
    )
    with pytest.raises(ValueError, match="Try increasing `gpu_memory_utilization`"):
        wrapped()


def test_an_engine_built_later_in_the_process_sees_no_earlier_cap(mocker) -> None:
    """A capped worker's state stays with its engine: an uncapped engine
    built afterwards in the same process (in-process engines, notebooks)
    gets vLLM's own errors, not one naming a cap that is not in force."""
    from vllm.config.compilation import CompilationConfig

    register()
    capped = _gpu_worker(40 * 1024)
    capped.vllm_config.compilation_config = CompilationConfig()
    WorkerState.of(capped.cache_config).gate = _gate(free=20 * GiB, requested=20 * GiB, limited=False)
    # The capped engine's worker: vLLM's budget (1 GiB) is above the cap, so the cap binds.
    assert (
        hooks.cap.worker_gate.check_cap_fits_instance(hooks.devices.cuda_free_memory, mocker.Mock(return_value=GiB))(
            capped
        )
        == GiB
    )
    assert WorkerState.peek(capped.vllm_config.compilation_config).cap_decision.bound  # the premise
    later = _gpu_worker(None)
    config = CompilationConfig()  # the later, uncapped engine's
    with pytest.raises(ValueError) as info:
        _resolve_full_cuda_graphs_for_16_sequences_in_10_mamba_blocks(config)
    assert type(info.value) is ValueError and "increase gpu_memory_utilization" in str(info.value)
    assert WorkerState.peek(later.cache_config) is None and WorkerState.peek(config) is None


def test_a_worker_keeps_its_state_in_one_object_on_each_of_its_vllm_objects(mocker, monkeypatch) -> None:
    """The gate and the cap decision of one CPU worker (vLLM's own
    ``CPUWorker``, through both of its hooks) are one ``WorkerState``, under
    one name on the worker, its config and the cache and compilation configs
    the hooks receive, and nothing else of the plugin's is kept on them."""
    worker, determine_available_memory = _profiled_cpu_worker(mocker, monkeypatch)
    budget = worker.requested_cpu_memory - RSS
    assert determine_available_memory(worker) == budget
    holders = (worker, worker.vllm_config, worker.cache_config, worker.vllm_config.compilation_config)
    kept = [sorted(name for name in vars(holder) if name.startswith("_kvcl_")) for holder in holders]
    assert kept == [["_kvcl_worker"]] * len(holders)
    state = WorkerState.peek(worker)
    assert state is not None and all(WorkerState.peek(holder) is state for holder in holders)
    assert state.gate is not None and state.gate.limited_by_free
    assert state.cap_decision is not None and state.cap_decision.budget == budget
