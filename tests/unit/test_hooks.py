"""The vLLM glue without an engine: the engine argument, the CLI flag, the
start-up hook, and the CUDA validation path with torch.cuda mocked."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from argparse import ArgumentError
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_kv_cache_limit import _bootstrap, register
from vllm_kv_cache_limit.policy import KVCacheMaxMemoryError

GiB = 2**30
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


@pytest.mark.parametrize(("value", "expected"), [("8G", 8 * GiB), ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * GiB)), ("1000", 1000)])
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
    for text in ("upper bound", "per device", "smaller of vLLM's own budget", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "8G", "512MiB", "1.5GiB"):
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


# --- CUDA validation path: no GPU here, so torch.cuda is mocked ------------


def _gpu_worker(cap: int | None):
    return SimpleNamespace(cache_config=SimpleNamespace(kv_cache_max_memory=cap))


def test_cuda_free_memory_check_refuses_before_profiling(mocker) -> None:
    from vllm_kv_cache_limit import _hooks

    mocker.patch("torch.cuda.mem_get_info", return_value=(10 * GiB, 80 * GiB))
    mocker.patch("torch.cuda.current_device", return_value=0)
    original = mocker.Mock(return_value=12 * GiB)
    wrapped = _hooks._check_free_memory(_hooks._cuda_free_memory, original)
    with pytest.raises(KVCacheMaxMemoryError) as info:
        wrapped(_gpu_worker(11 * GiB))
    assert "10.00 GiB free of 80.00 GiB total" in str(info.value)
    assert "cuda:0" in str(info.value)
    original.assert_not_called()  # vLLM's profiling and KV sizing never ran


def test_cuda_free_memory_check_passes_within_tolerance(mocker) -> None:
    from vllm_kv_cache_limit import _hooks

    mem_get_info = mocker.patch("torch.cuda.mem_get_info", return_value=(10 * GiB, 80 * GiB))
    mocker.patch("torch.cuda.current_device", return_value=0)
    original = mocker.Mock(return_value=12 * GiB)
    wrapped = _hooks._check_free_memory(_hooks._cuda_free_memory, original)
    worker = _gpu_worker(int(10 * GiB * 1.005))
    assert wrapped(worker) == 12 * GiB
    original.assert_called_once_with(worker)
    mem_get_info.assert_called_once()


def test_cuda_check_skipped_without_cap(mocker) -> None:
    from vllm_kv_cache_limit import _hooks

    mem_get_info = mocker.patch("torch.cuda.mem_get_info")
    original = mocker.Mock(return_value=5)
    assert _hooks._check_free_memory(_hooks._cuda_free_memory, original)(_gpu_worker(None)) == 5
    mem_get_info.assert_not_called()


def test_cuda_fail_fast_uses_nvml_total(mocker) -> None:
    """On CUDA the device total comes from the platform (NVML), not torch.cuda."""
    from vllm_kv_cache_limit import _hooks

    platform = mocker.Mock()
    platform.is_cpu.return_value = False
    platform.device_type = "cuda"
    platform.get_device_total_memory.return_value = 80 * GiB
    mocker.patch("vllm.platforms.current_platform", platform)
    cuda_init = mocker.patch("torch.cuda.init")
    assert _hooks._device_total_memory() == (80 * GiB, "cuda:0")
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
