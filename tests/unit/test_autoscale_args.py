"""The autoscaling engine arguments and CLI flags (``--kv-cache-autoscale``,
``--kv-cache-min-memory``, ``--kv-cache-shared-budget``), without an engine:
parsed, refused quoting the input, documented from ``config.py``, and their
settings checked by ``create_engine_config`` before anything loads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from argparse import ArgumentError
from pathlib import Path

import pytest

from vllm_kv_cache_limit import config, register
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

GiB = 2**30
MiB = 2**20
# EngineArgs resolves the model path offline; any local folder will do here.
LOCAL_MODEL = str(Path(__file__).parent)
FLAGS = {
    "--kv-cache-autoscale": "kv_cache_autoscale",
    "--kv-cache-min-memory": "kv_cache_min_memory",
    "--kv-cache-shared-budget": "kv_cache_shared_budget",
}


@pytest.fixture(scope="module")
def vllm_modules():
    register()
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs, AsyncEngineArgs, FlexibleArgumentParser


@pytest.fixture
def no_cap_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.MAX_MEMORY, raising=False)
    monkeypatch.delenv(envs.SHRINK_AFTER_S, raising=False)


def _parser(vllm_modules):
    EngineArgs, _, FlexibleArgumentParser = vllm_modules
    return EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))


def _docstrings() -> dict[str, str]:
    """The docstring under each field of ``KVCacheLimitConfig``, read from
    the source with ``ast`` (not as the plugin reads it)."""
    tree = ast.parse(inspect.getsource(config))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVCacheLimitConfig")
    docs = {}
    for field, after in zip(cls.body, cls.body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _words(text: str) -> str:
    return " ".join(text.split())


# --- parsing ----------------------------------------------------------------------


def test_the_flags_parse(vllm_modules) -> None:
    EngineArgs, _, _ = vllm_modules
    argv = [
        "--model",
        LOCAL_MODEL,
        "--kv-cache-max-memory",
        "2G",
        "--kv-cache-autoscale",
        "--kv-cache-min-memory",
        "4M",
        "--kv-cache-shared-budget",
        "1G",
    ]
    args = _parser(vllm_modules).parse_args(argv)
    assert args.kv_cache_autoscale is True
    assert args.kv_cache_min_memory == 4194304
    assert args.kv_cache_shared_budget == 1073741824
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_autoscale is True
    assert engine_args.kv_cache_min_memory == 4 * MiB
    assert engine_args.kv_cache_shared_budget == GiB
    assert engine_args.kv_cache_max_memory == 2 * GiB


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--kv-cache-min-memory", "512MiB", 512 * MiB),
        ("--kv-cache-min-memory", "1.5GiB", int(1.5 * GiB)),
        ("--kv-cache-min-memory", "1000", 1000),
        ("--kv-cache-shared-budget", "16GB", 16 * 10**9),
        ("--kv-cache-shared-budget", "40G", 40 * GiB),
    ],
)
def test_size_flags_take_every_size_form(vllm_modules, flag: str, value: str, expected: int) -> None:
    args = _parser(vllm_modules).parse_args([f"{flag}={value}"])
    assert getattr(args, FLAGS[flag]) == expected


def test_defaults_and_no_autoscale(vllm_modules) -> None:
    EngineArgs, _, _ = vllm_modules
    args = _parser(vllm_modules).parse_args([])
    assert (args.kv_cache_autoscale, args.kv_cache_min_memory, args.kv_cache_shared_budget) == (False, None, None)
    assert (
        _parser(vllm_modules).parse_args(["--kv-cache-autoscale", "--no-kv-cache-autoscale"]).kv_cache_autoscale
        is False
    )
    assert (
        _parser(vllm_modules).parse_args(["--no-kv-cache-autoscale", "--kv-cache-autoscale"]).kv_cache_autoscale is True
    )
    plain = EngineArgs(model=LOCAL_MODEL)
    assert (plain.kv_cache_autoscale, plain.kv_cache_min_memory, plain.kv_cache_shared_budget) == (False, None, None)


@pytest.mark.parametrize("flag", ["--kv-cache-min-memory", "--kv-cache-shared-budget"])
@pytest.mark.parametrize("value", ["4X", "0", "-1G", "1e9", "nan", "4 gigs"])
def test_malformed_sizes_are_refused_quoting_them(vllm_modules, flag: str, value: str) -> None:
    with pytest.raises(ArgumentError) as info:
        _parser(vllm_modules).parse_args([f"{flag}={value}"])
    assert repr(value) in str(info.value)
    assert flag in str(info.value)


def test_the_autoscale_flag_takes_no_value(vllm_modules) -> None:
    with pytest.raises(ArgumentError, match="--kv-cache-autoscale"):
        _parser(vllm_modules).parse_args(["--kv-cache-autoscale=yes"])


def test_the_size_flags_need_a_value(vllm_modules) -> None:
    for flag in ("--kv-cache-min-memory", "--kv-cache-shared-budget"):
        with pytest.raises(ArgumentError, match=flag):
            _parser(vllm_modules).parse_args([flag])


# --- engine arguments ------------------------------------------------------------


def test_engine_args_fields(vllm_modules) -> None:
    EngineArgs, AsyncEngineArgs, _ = vllm_modules
    for cls in (EngineArgs, AsyncEngineArgs):
        names = [f.name for f in dataclasses.fields(cls)]
        for field in FLAGS.values():
            assert field in names, (cls, field)
        args = cls(model=LOCAL_MODEL, kv_cache_autoscale=True, kv_cache_min_memory="256MiB", kv_cache_shared_budget=GiB)
        assert (args.kv_cache_autoscale, args.kv_cache_min_memory, args.kv_cache_shared_budget) == (
            True,
            256 * MiB,
            GiB,
        )
        copied = dataclasses.asdict(args)
        assert (copied["kv_cache_autoscale"], copied["kv_cache_min_memory"], copied["kv_cache_shared_budget"]) == (
            True,
            256 * MiB,
            GiB,
        )


@pytest.mark.parametrize("value", ["yes", "True", 1, 0, "false"])
def test_engine_args_refuse_a_non_bool_autoscale_quoting_it(vllm_modules, value: object) -> None:
    EngineArgs, _, _ = vllm_modules
    with pytest.raises(ValueError) as info:
        EngineArgs(model=LOCAL_MODEL, kv_cache_autoscale=value)
    assert repr(value) in str(info.value)
    assert "kv_cache_autoscale" in str(info.value)


@pytest.mark.parametrize("field", ["kv_cache_min_memory", "kv_cache_shared_budget"])
def test_engine_args_refuse_a_bad_size_quoting_it(vllm_modules, field: str) -> None:
    EngineArgs, _, _ = vllm_modules
    with pytest.raises(ValueError, match=r"Invalid size '8 gigs'"):
        EngineArgs(model=LOCAL_MODEL, **{field: "8 gigs"})


# --- help ---------------------------------------------------------------------------


def test_the_docstrings_are_found() -> None:
    docs = _docstrings()
    assert set(FLAGS.values()) | {"kv_cache_max_memory"} <= set(docs)
    assert docs["kv_cache_min_memory"].startswith("The least KV cache an autoscaled engine keeps")


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_the_help_of_each_flag_is_its_docstring(vllm_modules, flag: str) -> None:
    parser = _parser(vllm_modules)
    group = next(g for g in parser._action_groups if g.title == "CacheConfig")
    (action,) = [a for a in group._group_actions if flag in a.option_strings]
    assert action.dest == FLAGS[flag]
    assert _words(action.help) == _words(_docstrings()[FLAGS[flag]])
    # The help is the flag's own, not another field's.
    for other in set(FLAGS.values()) - {FLAGS[flag]}:
        assert _words(action.help) != _words(_docstrings()[other])


def test_the_usage_shows_the_flags(vllm_modules) -> None:
    usage = _words(_parser(vllm_modules).format_usage())
    for shown in (
        "[--kv-cache-autoscale | --no-kv-cache-autoscale]",
        "[--kv-cache-min-memory SIZE]",
        "[--kv-cache-shared-budget SIZE]",
    ):
        assert shown in usage, shown


# --- create_engine_config checks the settings before anything loads --------------


@pytest.mark.usefixtures("no_cap_from_the_environment")
@pytest.mark.parametrize(
    ("kwargs", "parts"),
    [
        ({"kv_cache_min_memory": "1G"}, ["--kv-cache-min-memory applies only with --kv-cache-autoscale"]),
        ({"kv_cache_shared_budget": "2G"}, ["--kv-cache-shared-budget applies only with --kv-cache-autoscale"]),
        (
            {"kv_cache_min_memory": "1G", "kv_cache_shared_budget": "2G"},
            ["--kv-cache-min-memory and --kv-cache-shared-budget apply only with --kv-cache-autoscale"],
        ),
        ({"kv_cache_autoscale": True}, ["--kv-cache-autoscale needs a cap", "--kv-cache-max-memory SIZE"]),
        (
            {"kv_cache_max_memory": "1G", "kv_cache_autoscale": True, "kv_cache_min_memory": "2G"},
            ["--kv-cache-min-memory 2GiB", f"({2 * GiB} bytes)", "--kv-cache-max-memory 1GiB"],
        ),
        (
            {
                "kv_cache_max_memory": "4G",
                "kv_cache_autoscale": True,
                "kv_cache_min_memory": "2G",
                "kv_cache_shared_budget": "1G",
            },
            ["--kv-cache-shared-budget 1GiB", f"({GiB} bytes) is below", "--kv-cache-min-memory 2GiB"],
        ),
    ],
)
def test_create_engine_config_refuses_settings_that_cannot_work(vllm_modules, kwargs: dict, parts: list[str]) -> None:
    EngineArgs, _, _ = vllm_modules
    with pytest.raises(KVCacheMaxMemoryError) as info:
        EngineArgs(model=LOCAL_MODEL, **kwargs).create_engine_config()
    for part in parts:
        assert part in str(info.value), str(info.value)


def test_create_engine_config_refuses_a_bad_hysteresis_quoting_it(
    vllm_modules, no_cap_from_the_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    EngineArgs, _, _ = vllm_modules
    monkeypatch.setenv(envs.SHRINK_AFTER_S, "soon")
    with pytest.raises(KVCacheMaxMemoryError, match=rf"{envs.SHRINK_AFTER_S}='soon'"):
        EngineArgs(model=LOCAL_MODEL, kv_cache_max_memory="1G", kv_cache_autoscale=True).create_engine_config()


def test_the_cap_from_the_environment_counts_for_autoscale(
    vllm_modules, no_cap_from_the_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``VLLM_KV_CACHE_MAX_MEMORY`` is a cap like the flag: a floor above it is refused."""
    EngineArgs, _, _ = vllm_modules
    monkeypatch.setenv(envs.MAX_MEMORY, "1G")
    with pytest.raises(
        KVCacheMaxMemoryError, match=r"--kv-cache-min-memory 3GiB .* is above --kv-cache-max-memory 1GiB"
    ):
        EngineArgs(model=LOCAL_MODEL, kv_cache_autoscale=True, kv_cache_min_memory="3G").create_engine_config()


@pytest.mark.usefixtures("no_cap_from_the_environment")
@pytest.mark.parametrize("ranks", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_autoscale_with_ranks_that_each_schedule_is_refused(vllm_modules, tiny_model: str, ranks: dict) -> None:
    """``external_launcher`` with tensor or pipeline parallel: every rank's
    process has its own scheduler (checked once the parallel config is
    known, before anything loads); the same cap without autoscaling passes."""
    EngineArgs, _, _ = vllm_modules
    args = {"model": tiny_model, "kv_cache_max_memory": "1G", "distributed_executor_backend": "external_launcher"}
    with pytest.raises(KVCacheMaxMemoryError) as info:
        EngineArgs(**args, **ranks, kv_cache_autoscale=True).create_engine_config()
    assert "--kv-cache-autoscale cannot run with --distributed-executor-backend external_launcher and 2" in str(
        info.value
    ), str(info.value)
    config = EngineArgs(**args, **ranks).create_engine_config()
    assert config.parallel_config.distributed_executor_backend == "external_launcher"
    assert config.parallel_config.world_size == 2


def test_registration_leaves_a_vllm_without_its_environment_table_untouched(
    vllm_modules, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``vllm.envs.environment_variables`` renamed in vLLM: registering the
    plugin's variables (first in every ``create_engine_config``, cap or not)
    must not crash; with a cap, the start-up check names the attribute
    (``compat.ATTRIBUTES``)."""
    import sys
    import types

    import vllm

    from vllm_kv_cache_limit import compat
    from vllm_kv_cache_limit.hooks.cap.arg_utils import register_environment_variables

    renamed = types.ModuleType("vllm.envs")
    renamed.environment_variables_v2 = {}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.envs", renamed)
    monkeypatch.setattr(vllm, "envs", renamed)
    monkeypatch.setenv(envs.LOCK_DIR, "/tmp")  # a plugin variable that would be registered
    register_environment_variables()
    assert renamed.environment_variables_v2 == {}
    assert "vllm.envs.environment_variables" in {a.name for a in compat.ATTRIBUTES}
