"""Installed but unused, the plugin changes nothing: same KV cache, same
greedy output, same log warnings and same CLI help (apart from the new flag)
as with the plugin excluded through ``VLLM_PLUGINS`` (which also keeps its
start-up hook off). Under ``make test-upstream`` the same comparisons hold
between the patched vLLM and the same release unpatched."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys

import pytest

from tests.conftest import REFERENCE_PYTHON, UPSTREAM
from tests.e2e.conftest import REPO, engine_env
from tests.e2e.test_version_drift import KV_SIZE, expected_blocks
from vllm_kv_cache_limit.hooks.runtime.server import ENABLE_FLAG as RESIZE_FLAG
from vllm_kv_cache_limit.logic.autoscale_policy import AUTOSCALE_FLAG, MIN_MEMORY_FLAG, SHARED_BUDGET_FLAG
from vllm_kv_cache_limit.logic.cap_decision import FLAG

WITHOUT_PLUGIN = {"VLLM_PLUGINS": ""}
WITHOUT_PYTHON = REFERENCE_PYTHON if UPSTREAM else None
"""What runs "without": this interpreter with the plugin excluded or, under
``make test-upstream``, the unpatched vLLM's."""
if UPSTREAM and not REFERENCE_PYTHON:
    raise RuntimeError("make test-upstream sets KV_CACHE_LIMIT_REFERENCE_PYTHON (the unpatched vLLM)")
PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4"]


def _head(levels: str) -> str:
    """The head of a vLLM log record at one of ``levels``:
    "(EngineCore pid=123) WARNING 11-30 03:38:00 [file.py:12] "."""
    return rf"(?:\([A-Za-z_]+[^)]*\) )?(?P<level>{levels}) \S+ \S+ \[[^\]]+\] "


# Searched, not matched at the line start: processes share one stderr, and
# another process's partial line can come first.
_LOG_PREFIX = re.compile(_head("WARNING|ERROR") + r"(?P<msg>.*)$")
_LOG_RECORD = re.compile("^" + _head("DEBUG|INFO|WARNING|ERROR"))


def program_output(stdout: str) -> list[str]:
    """The lines a program printed, less vLLM's log records: vLLM logs to
    stdout, and some releases log at import (0.29: "Triton is installed, but
    ..."), with the time in each line."""
    return [line for line in stdout.split("\n") if not _LOG_RECORD.match(line)]


def warnings_of(log: str) -> list[str]:
    """The distinct WARNING and ERROR messages of vLLM, without pids, times,
    line numbers and the process tag. Distinct, because how often a process
    repeats one varies run to run; without the tag, because processes share
    one stderr and a tag can land on another process's line (vLLM 0.29 once
    showed a worker's warning untagged in one run of two); shutdown messages
    ("force killing remaining process ...") are left out for the same reason."""
    found = []
    for line in log.splitlines():
        match = _LOG_PREFIX.search(line)
        if match and not match["msg"].startswith("[shutdown]"):
            found.append(f"{match['level']} {match['msg']}")
    return sorted(set(found))


@pytest.mark.smoke
@pytest.mark.plugin_only  # the plugin's exclusion
def test_plugin_is_really_excluded_by_vllm_plugins() -> None:
    """The comparison below means something only if ``VLLM_PLUGINS=""``
    keeps every hook off, the start-up hook included."""
    code = (
        "import sys; from vllm.engine.arg_utils import EngineArgs; "
        "print('field', 'kv_cache_max_memory' in EngineArgs.__dataclass_fields__); "
        "print('hooked', any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))"
    )
    outputs = {}
    for name, extra in (("on", {}), ("off", WITHOUT_PLUGIN)):
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=engine_env(**extra), cwd=REPO, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs[name] = program_output(proc.stdout)
    assert outputs["on"][:2] == ["field True", "hooked True"]
    assert outputs["off"][:2] == ["field False", "hooked False"]


@pytest.mark.smoke
def test_same_kv_cache_and_greedy_output_without_the_flag(probe, tiny_model: str) -> None:
    spec = {"kv_cache_memory_bytes": KV_SIZE, "prompts": PROMPTS, "max_tokens": 16}
    with_plugin, log_on = probe(**spec)
    without, log_off = probe(env=WITHOUT_PLUGIN, python=WITHOUT_PYTHON, **spec)
    assert with_plugin["ok"], log_on[-4000:]
    assert without["ok"], log_off[-4000:]

    for key in ("num_gpu_blocks", "block_size", "kv_cache_bytes", "max_model_len", "texts"):
        assert with_plugin[key] == without[key], key
    # And both are what the explicit size gives, so the runs were comparable.
    assert without["num_gpu_blocks"] == expected_blocks(tiny_model, KV_SIZE, without["block_size"])
    assert len(with_plugin["texts"]) == len(PROMPTS) and any(t.strip() for t in with_plugin["texts"])

    assert with_plugin["kv_cache_max_memory"] is None
    assert "KV cache max memory" not in log_on
    assert "kv-cache-limit" not in log_on.lower()
    assert warnings_of(log_on) == warnings_of(log_off)


def _help(extra_env: dict[str, str], python: str | None = None) -> str:
    proc = subprocess.run(
        [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help=all"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=engine_env(COLUMNS="100", **extra_env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return "\n".join(program_output(proc.stdout))


def _split_usage(text: str) -> tuple[list[str], list[str]]:
    """The usage tokens (wrapping ignored) and the remaining lines."""
    lines = text.splitlines()
    end = lines.index("") if "" in lines else len(lines)
    return " ".join(lines[:end]).split(), lines[end:]


def _without_flag_entry(lines: list[str], flag: str = FLAG) -> list[str]:
    """``lines`` less the help entry of ``flag``: its option line and the
    deeper-indented lines that follow it."""
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(flag))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    assert end - start > 1, "the flag has no help text"
    return lines[:start] + lines[end:]


AUTOSCALE_FLAGS = (AUTOSCALE_FLAG, MIN_MEMORY_FLAG, SHARED_BUDGET_FLAG)
AUTOSCALE_USAGE = (
    ["[" + AUTOSCALE_FLAG, "|", "--no-" + AUTOSCALE_FLAG.removeprefix("--") + "]"],
    ["[" + MIN_MEMORY_FLAG, "SIZE]"],
    ["[" + SHARED_BUDGET_FLAG, "SIZE]"],
)
"""How argparse writes the autoscaling flags in the usage line."""


@pytest.mark.smoke
def test_cli_help_of_every_other_option_is_unchanged() -> None:
    with_plugin, without = _help({}), _help(WITHOUT_PLUGIN, WITHOUT_PYTHON)
    assert FLAG not in without
    usage_on, rest_on = _split_usage(with_plugin)
    usage_off, rest_off = _split_usage(without)
    flag_usage = ["[" + FLAG, "SIZE]"]
    at = usage_on.index(flag_usage[0])
    assert usage_on[at : at + 2] == flag_usage
    usage_on = usage_on[:at] + usage_on[at + 2 :]
    if not UPSTREAM:  # the server's own flag for run-time resize (off by default), and autoscaling's
        usage_on.remove(f"[{RESIZE_FLAG}]")
        for tokens in AUTOSCALE_USAGE:
            at = usage_on.index(tokens[0])
            assert usage_on[at : at + len(tokens)] == tokens, usage_on[at : at + len(tokens)]
            usage_on = usage_on[:at] + usage_on[at + len(tokens) :]
    assert usage_on == usage_off
    rest_on = _without_flag_entry(rest_on)
    if not UPSTREAM:
        for flag in (RESIZE_FLAG, *AUTOSCALE_FLAGS):
            rest_on = _without_flag_entry(rest_on, flag)
    assert all(flag not in "\n".join(rest_on) for flag in (FLAG, RESIZE_FLAG, *AUTOSCALE_FLAGS))
    diff = "\n".join(difflib.unified_diff(rest_off, rest_on, "without plugin", "with plugin", lineterm=""))
    assert rest_on == rest_off, diff[:4000]
