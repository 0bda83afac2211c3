"""Under ``make test-upstream``: the vLLM under test is patched and the plugin
is absent, so what the other tests see is vLLM's own cap."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REFERENCE_PYTHON, UPSTREAM
from tests.e2e.conftest import engine_env

pytestmark = [pytest.mark.smoke, pytest.mark.skipif(not UPSTREAM, reason="make test-upstream only")]

CHECK = """
import importlib.metadata, sys
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
try:
    importlib.metadata.distribution("vllm-kv-cache-limit")
    installed = True
except importlib.metadata.PackageNotFoundError:
    installed = False
print("version", vllm.__version__)
print("field", "kv_cache_max_memory" in EngineArgs.__dataclass_fields__)
print("installed", installed)
print("plugins", [p for p in plugins if "kv_cache_limit" in p])
print("imported", sorted(m for m in sys.modules if m.startswith("vllm_kv_cache_limit")))
"""


def _facts(python: str, **env: str) -> list[str]:
    # cwd "/": only what is installed is found.
    proc = subprocess.run(
        [python, "-c", CHECK], capture_output=True, text=True, timeout=300, env=engine_env(**env), cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [
        line
        for line in proc.stdout.splitlines()
        if line.split(" ", 1)[0] in ("version", "field", "installed", "plugins", "imported")
    ]


def test_the_cap_is_vllms_own_and_the_plugin_is_absent() -> None:
    facts = _facts(sys.executable)
    assert facts[1:] == ["field True", "installed False", "plugins []", "imported []"], facts


def test_the_reference_is_the_same_release_unpatched() -> None:
    assert REFERENCE_PYTHON, "KV_CACHE_LIMIT_REFERENCE_PYTHON is not set"
    # As the comparisons run it: the plugin excluded, so vLLM has no such field.
    patched, reference = _facts(sys.executable), _facts(REFERENCE_PYTHON, VLLM_PLUGINS="")
    assert patched[0] == reference[0], (patched, reference)  # the same vLLM release
    assert reference[1] == "field False", reference
