"""Bad values for ``--kv-cache-max-memory`` and ``kv_cache_max_memory=`` are
refused where the user typed them: argparse errors for the CLI (exit status
2 from the API server), ``ValueError`` from ``EngineArgs`` and ``LLM(...)``,
each quoting the value, before any engine starts."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from argparse import ArgumentError, ArgumentParser

import psutil
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from vllm_kv_cache_limit.logic.cap_decision import ENV_VAR, FLAG
from vllm_kv_cache_limit.logic.sizes import parse_size

BAD_VALUES = ["8 gigs", "-1G", "1.5.5G", "0", "", "lots", "8Gb/s", "1e9"]
fuzz = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes = st.builds(
    lambda number, unit, space: f"{number}{space}{unit}",
    st.one_of(st.integers(min_value=1, max_value=10**6).map(str), st.from_regex(r"\A[0-9]{1,3}\.[0-9]{1,3}\Z")),
    st.sampled_from(["", "B", "K", "M", "G", "k", "m", "g", "KiB", "mib", "GI", "KB", "mb", "Gb", "TiB"]),
    st.sampled_from(["", " "]),
)


@functools.lru_cache(maxsize=1)
def cli_parser() -> ArgumentParser:
    """vLLM's engine argument parser, built as vLLM's entry points build it,
    raising instead of exiting."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))


def test_flag_is_in_the_cache_config_group() -> None:
    parser = cli_parser()
    group = next(g for g in parser._action_groups if g.title == "CacheConfig")
    assert any(FLAG in a.option_strings for a in group._group_actions)
    assert parser.parse_args([]).kv_cache_max_memory is None


@fuzz
@given(sizes)
@example("8G")
@example("1.5 GiB")
def test_cli_parses_valid_sizes_to_bytes(value: str) -> None:
    expected = parse_size(value) if _valid(value) else None
    if expected is None:
        with pytest.raises(ArgumentError):
            cli_parser().parse_args([f"{FLAG}={value}"])
        return
    assert cli_parser().parse_args([f"{FLAG}={value}"]).kv_cache_max_memory == expected
    # The spelling with a space between flag and value, as users type it.
    assert cli_parser().parse_args([FLAG, value]).kv_cache_max_memory == expected


@fuzz
@given(st.text())
@example("8 gigs")
@example("-1G")
@example("1.5.5")
@example("--help")
@example("8G --port 1")
def test_cli_refuses_junk_with_argument_error_quoting_it(value: str) -> None:
    """Any text after ``--kv-cache-max-memory=`` parses to what
    ``parse_size`` says, or raises ``ArgumentError`` quoting the value."""
    try:
        namespace = cli_parser().parse_args([f"{FLAG}={value}"])
    except ArgumentError as exc:
        assert FLAG in str(exc)
        assert repr(value) in str(exc), f"{exc} does not quote {value!r}"
        assert not _valid(value)
        return
    assert namespace.kv_cache_max_memory == parse_size(value)


@fuzz
@given(
    st.one_of(
        st.text(), st.none(), st.booleans(), st.floats(), st.integers(max_value=0), st.lists(st.integers(), max_size=2)
    )
)
@example("8 gigs")
@example(1.5)
def test_engine_args_refuse_junk_with_value_error_quoting_it(value: object) -> None:
    from vllm.engine.arg_utils import EngineArgs

    if value is None or (isinstance(value, str) and _valid(value)):
        return  # valid values start a real configuration; see below
    with pytest.raises(ValueError) as info:
        EngineArgs(model="unused", kv_cache_max_memory=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"), [("16M", 16 * 2**20), ("1.5GiB", 3 * 2**29), (4096, 4096), (None, None)]
)
def test_engine_args_store_bytes(tiny_model: str, value: str | int | None, expected: int | None) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    for cls in (EngineArgs, AsyncEngineArgs):
        assert cls(model=tiny_model, kv_cache_max_memory=value).kv_cache_max_memory == expected


@pytest.mark.parametrize("value", BAD_VALUES + [0.5, -1, True])
def test_llm_refuses_bad_values_before_any_engine_starts(value: object) -> None:
    """``LLM(...)`` raises ``ValueError`` quoting the value; the model is
    never looked at and no process is started."""
    from vllm import LLM

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as info:
        LLM(model="no-such-model-is-ever-loaded", kv_cache_max_memory=value)
    assert repr(value) in str(info.value)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


@pytest.mark.parametrize("value", ["8 gigs", "-1G"])
def test_llm_refuses_bad_environment_variable(monkeypatch: pytest.MonkeyPatch, tiny_model: str, value: str) -> None:
    """The environment variable is checked as strictly as the argument, and
    the error names it, before the engine configuration is built."""
    from vllm import LLM

    monkeypatch.setenv(ENV_VAR, value)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError) as info:
        LLM(model=tiny_model, max_model_len=512, enforce_eager=True)
    assert ENV_VAR in str(info.value)
    assert repr(value) in str(info.value)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_api_server_exits_2_quoting_the_bad_value() -> None:
    """The OpenAI API server, as users start it: argparse's exit status 2
    and an ``error:`` line that quotes the value and says what would work."""
    bad = "8 gigs"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop(ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "unused", FLAG, bad],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors, proc.stderr[-3000:]
    assert FLAG in errors[-1] and repr(bad) in errors[-1]
    assert "for example" in errors[-1]


def _valid(value: str) -> bool:
    try:
        parse_size(value)
    except ValueError:
        return False
    return True


def test_cli_refuses_gigabits_naming_the_bytes_spelling() -> None:
    """``--kv-cache-max-memory 8Gb``: vLLM's size flags take no ``b``, and a
    lower-case one means bits; refused, naming ``8GB``, which the flag takes."""
    with pytest.raises(ArgumentError, match=r"bits.*'8GB'"):
        cli_parser().parse_args([FLAG, "8Gb"])
    assert cli_parser().parse_args([FLAG, "8GB"]).kv_cache_max_memory == 8 * 10**9
