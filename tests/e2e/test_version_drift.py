"""vLLM drift, simulated on real engines: the plugin expects a hook that the
installed vLLM does not have (or has with other parameters).

The drift is set up in every process of the run (first process, engine core,
workers) by a ``sitecustomize`` module on ``PYTHONPATH`` that edits
the registry's entry (``compat.registry``) before vLLM is imported, as a changed vLLM would look to
the plugin. With the cap set, start-up must fail naming the installed vLLM,
the supported range and the hook; without it, vLLM must run unchanged with
exactly one warning that the plugin is inactive.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from vllm_kv_cache_limit import compat

MiB = 2**20
KV_SIZE = 48 * MiB
"""An explicit KV cache size, so that the block count does not depend on the
worker's resident memory (vLLM's own CPU budget does)."""

SITECUSTOMIZE = '''\
"""Simulated vLLM drift for vllm-kv-cache-limit's tests ({kind})."""
import dataclasses

from vllm_kv_cache_limit.compat import Hook, registry

# The entry is declared beside its wrapper; the wrapper's module checks it
# by that name, and the registry reads the module's HOOKS.
for _module in registry.modules(registry.CAP_MODULES):
    for _name, _hook in list(vars(_module).items()):
        if isinstance(_hook, Hook) and _hook.qualname == {qualname!r}:
            _drifted = dataclasses.replace(_hook, **{changes!r})
            setattr(_module, _name, _drifted)
            _module.HOOKS = tuple(_drifted if h is _hook else h for h in _module.HOOKS)
'''

DRIFTS = {
    # vLLM moved get_kv_cache_configs out of the module the plugin hooks.
    "missing": (
        "get_kv_cache_configs",
        {"modules": ("vllm.v1.engine.kv_cache_planner",)},
        "vllm.v1.engine.kv_cache_planner.get_kv_cache_configs is missing",
    ),
    # vLLM renamed a parameter the plugin relies on.
    "changed": (
        "CPUWorker.determine_available_memory",
        {"params": ("self", "profile")},
        "vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory has changed shape",
    ),
}


def drift_env(tmp_dir: Path, kind: str = "missing") -> tuple[dict[str, str], str]:
    """Environment additions that simulate drift ``kind`` in every process,
    and the problem the plugin must report."""
    qualname, changes, problem = DRIFTS[kind]
    folder = tmp_dir / f"drift-{kind}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(kind=kind, qualname=qualname, changes=changes))
    pythonpath = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath}, problem


def expected_blocks(model: str, kv_bytes: int, block_size: int) -> int:
    """Whole blocks of ``block_size`` tokens that ``kv_bytes`` hold for the
    tiny model: K and V, every layer, every KV head, bfloat16 (the CPU
    backend's KV dtype)."""
    import json

    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * block_size
    return kv_bytes // per_block


def assert_drift_error(result: dict, problem: str) -> None:
    assert not result["ok"], result
    assert result["error_type"] == "UnsupportedVLLMError", result
    assert "KVCacheMaxMemoryError" in result["error_mro"], result  # what users catch
    error = result["error"]
    assert f"vLLM {compat.installed_vllm_version()}" in error
    assert compat.SUPPORTED_VLLM[0] in error and compat.SUPPORTED_VLLM[1] in error
    assert problem in error


@pytest.mark.parametrize("kind", sorted(DRIFTS))
def test_flag_set_fails_before_the_engine_starts(probe, tmp_path: Path, kind: str) -> None:
    env, problem = drift_env(tmp_path, kind)
    result, log = probe(env=env, kv_cache_max_memory="16M")
    assert_drift_error(result, problem)
    # Refused in the first process: no engine core was ever started.
    assert "EngineCore pid=" not in log, log[-3000:]


def test_environment_variable_cap_fails_the_same_way(probe, tmp_path: Path) -> None:
    env, problem = drift_env(tmp_path, "missing")
    result, log = probe(env={**env, "VLLM_KV_CACHE_MAX_MEMORY": "16M"})
    assert_drift_error(result, problem)
    assert "EngineCore pid=" not in log


def test_flag_unset_runs_vllm_unchanged_with_one_warning(probe, tiny_model: str, tmp_path: Path) -> None:
    """The hooked engine-core function is missing: vLLM starts, sizes its KV
    cache and generates as without the plugin, and one warning (not one per
    process) says the plugin is inactive and why."""
    env, problem = drift_env(tmp_path, "missing")
    result, log = probe(env=env, kv_cache_memory_bytes=KV_SIZE, max_tokens=8)
    assert result["ok"], log[-4000:]
    warnings = [line for line in log.splitlines() if "vllm-kv-cache-limit is inactive" in line]
    assert len(warnings) == 1, warnings
    assert problem in warnings[0]
    assert compat.installed_vllm_version() in warnings[0]
    assert "KV cache max memory:" not in log
    assert result["kv_cache_max_memory"] is None
    blocks = expected_blocks(tiny_model, KV_SIZE, result["block_size"])
    assert result["num_gpu_blocks"] == blocks
    assert result["kv_cache_bytes"] == [KV_SIZE]
    assert result["texts"] and all(re.search(r"\S", t) for t in result["texts"]), result["texts"]
