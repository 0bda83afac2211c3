"""vllm-kv-sim's records of what it uses of vLLM (``sim/vllm_apis.py``):
every vLLM name a simulator module imports has one, each fits the installed
vLLM (and its source, as ``scripts/check_hooks.py`` checks each wheel), and
the registry lists them without the plugin importing the simulator."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kv_cache_limit.compat import registry

SIM = Path(registry.__file__).resolve().parents[1] / "sim"


def _vllm_imports() -> set[tuple[str, str, str]]:
    """(simulator module, vLLM module, name) of every ``from vllm... import name`` in ``sim/``, at any depth."""
    found = set()
    for path in sorted(SIM.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                found |= {(path.name, node.module or "", alias.name) for alias in node.names}
    return found


def test_every_vllm_name_the_simulator_imports_has_a_record() -> None:
    imports = _vllm_imports()
    assert any(name == "Scheduler" for _, _, name in imports)  # the premise: the scan sees instance.py's imports
    recorded = {h.qualname.split(".")[0] for h in registry.sim_hooks()}
    recorded |= {a.owner or a.attr for a in registry.sim_attributes()}
    missing = sorted(f"{where}: from {module} import {name}" for where, module, name in imports if name not in recorded)
    assert missing == [], f"add a Hook or Attribute to sim/vllm_apis.py for: {missing}"


def test_the_records_fit_the_installed_vllm_and_its_source() -> None:
    pytest.importorskip("vllm")
    from vllm_kv_cache_limit import compat
    from vllm_kv_cache_limit.compat.live import _installed_root

    hooks, attributes = registry.sim_hooks(), registry.sim_attributes()
    assert len(hooks) >= 20 and len(attributes) >= 40
    assert compat.check_hooks(hooks) == []
    assert compat.check_attributes(attributes) == []
    root = _installed_root()
    assert root is not None
    version = compat.installed_vllm_version()
    assert compat.check_hooks_in_source(root, hooks, version) == []
    assert compat.check_attributes_in_source(root, compat.for_version(attributes, version)) == []
    # The checks can fail: a renamed method and a renamed field are each named.
    scheduler = next(h for h in hooks if h.qualname == "Scheduler.__init__")
    renamed = dataclasses.replace(scheduler, qualname="Scheduler.no_such_method")
    assert compat.check_hooks((renamed,)) != [] and compat.check_hooks_in_source(root, (renamed,)) != []
    field = dataclasses.replace(attributes[0], attr="no_such_field")
    assert compat.check_attributes((field,)) != [] and compat.check_attributes_in_source(root, (field,)) != []


def test_the_registry_lists_the_simulator_without_importing_it() -> None:
    """In a fresh interpreter: the registry names sim.vllm_apis, yet neither
    loading it, nor the plugin's hooks and targets, import the simulator."""
    code = (
        "import json, sys\n"
        "from vllm_kv_cache_limit.compat import registry\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('vllm_kv_cache_limit.sim'))\n"
        "plugin = registry.CAP_MODULES + registry.RESIZE_MODULES\n"
        "print(json.dumps({'sim': registry.SIM_MODULES, 'loaded': loaded, 'plugin': plugin}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["sim"] == ["sim.vllm_apis"]
    assert seen["loaded"] == []
    assert not any(name.startswith("sim") for name in seen["plugin"])
