"""pytest plugin for vLLM's own unit tests in a CUDA-wheel environment without
a GPU (``scripts/vllm_own_tests.py``, ``pytest -p vllm_own_platform`` with
``scripts/`` on ``PYTHONPATH``).

Once collection has imported the test modules (and vLLM, the platform still
"unspecified"), it puts vLLM's own CUDA platform in place on one faked GPU:
torch's CUDA readings and NVML, the fakes of ``tests/cuda_wheel/conftest.py``
(loaded from its file: the name ``tests`` is vLLM's here). Set before the
imports, vLLM's attention and quantization modules would load CUDA-only
extensions.

With ``KV_CACHE_LIMIT_OWN_OUTCOMES`` set to a file, it writes there each
test's outcome, a one-line message for those that did not pass, and which
of the plugin's hooks the run installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

OUTCOMES_ENV = "KV_CACHE_LIMIT_OWN_OUTCOMES"
FAKES = Path(__file__).resolve().parents[1] / "tests" / "cuda_wheel" / "conftest.py"

# vllm.platforms.cuda imports the stable-ABI kernels at the top, which need
# libcuda.so.1: an empty module stands in where the real one cannot load.
try:
    import vllm._C_stable_libtorch  # noqa: F401
except ImportError:
    sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")

_monkeypatch = pytest.MonkeyPatch()
_outcomes: dict[str, str] = {}
_messages: dict[str, str] = {}


def _load_fakes() -> types.ModuleType:
    """``tests/cuda_wheel/conftest.py`` as a plain module (its hooks inert)."""
    if (loaded := sys.modules.get("kv_cache_limit_cuda_wheel_fakes")) is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("kv_cache_limit_cuda_wheel_fakes", FAKES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


def fake_cuda_platform(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's ``NvmlCudaPlatform`` as the current platform, on one faked GPU
    (80 GiB, all free): the ``fake_gpu`` fixture of the CUDA-wheel tier."""
    return _load_fakes().install_fake_cuda(monkeypatch)


def pytest_collection_finish(session: pytest.Session) -> None:
    fake_cuda_platform(_monkeypatch)


def _message(report: pytest.CollectReport | pytest.TestReport) -> str:
    """A failure's exception (its first two lines), or a skip's reason."""
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[-1])[:300]
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " / ".join(lines[:2])[:300]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _outcomes[report.nodeid] = "collection error"
        _messages[report.nodeid] = _message(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    xfail = hasattr(report, "wasxfail")
    outcome: str
    if report.when == "call":
        outcome = ("xfailed" if report.skipped else "xpassed") if xfail else report.outcome
    elif report.failed:  # setup or teardown
        outcome = "error"
    elif report.when == "setup" and report.skipped:
        outcome = "xfailed" if xfail else "skipped"
    else:
        return
    _outcomes[report.nodeid] = outcome
    if outcome not in ("passed", "xpassed"):
        _messages[report.nodeid] = _message(report)


def _hooks() -> dict[str, Any]:
    """Whether the plugin's import hooks were installed in this run, and on
    which vLLM modules they ran."""
    bootstrap = sys.modules.get("vllm_kv_cache_limit._bootstrap")
    if bootstrap is None:
        return {"installed": False, "modules": [], "failed": {}}
    return {
        "installed": bool(bootstrap._installed),
        "modules": sorted(bootstrap._done),
        "failed": dict(bootstrap.failed),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _monkeypatch.undo()
    path = os.environ.get(OUTCOMES_ENV)
    if path:
        data = {"outcomes": _outcomes, "messages": _messages, "hooks": _hooks(), "exitstatus": int(exitstatus)}
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))
