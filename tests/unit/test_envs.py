"""The plugin's environment variables: user-facing ones registered with vLLM
when set, internal ones outside vLLM's ``VLLM_`` namespace."""

from __future__ import annotations

import os

from vllm_kv_cache_limit.logic import envs


def test_only_set_user_variables_are_registered() -> None:
    table: dict = {"VLLM_HOST_IP": lambda: None}
    environ = {envs.MAX_MEMORY: "16M", envs.LOCK_DIR: "/tmp/locks", "VLLM_UNRELATED": "1"}
    assert envs.register_with_vllm(table, environ) == [envs.MAX_MEMORY, envs.LOCK_DIR]
    assert set(table) == {"VLLM_HOST_IP", envs.MAX_MEMORY, envs.LOCK_DIR}
    assert envs.register_with_vllm(table, environ) == []  # once


def test_registered_reader_reads_the_live_environment(monkeypatch) -> None:
    table: dict = {}
    monkeypatch.setenv(envs.MAX_MEMORY, "16M")
    envs.register_with_vllm(table)
    monkeypatch.setenv(envs.MAX_MEMORY, "32M")
    assert table[envs.MAX_MEMORY]() == "32M" == os.environ[envs.MAX_MEMORY]


def test_internal_variables_are_not_vllms() -> None:
    for name in (envs.ERROR_FILE, envs.INACTIVE_WARNED):
        assert not name.startswith("VLLM_"), name
    assert all(name.startswith("VLLM_") for name in envs.USER_VARIABLES)


def test_vllm_validation_accepts_registered_variables(monkeypatch) -> None:
    """vLLM's own check, on its own table."""
    import vllm.envs
    from vllm.platforms.interface import Platform

    # vLLM 0.30+: the platform's check; 0.29: the same check in vllm.envs.
    validate = getattr(Platform, "validate_environ", None) or vllm.envs.validate_environ
    # vLLM's table as vLLM made it (an engine config built earlier in this
    # process may have registered the plugin's variables already).
    table = {k: v for k, v in vllm.envs.environment_variables.items() if k not in envs.USER_VARIABLES}
    monkeypatch.setattr(vllm.envs, "environment_variables", table)
    for name in list(os.environ):
        if name.startswith("VLLM_") and name not in vllm.envs.environment_variables:
            monkeypatch.delenv(name)
    monkeypatch.setenv(envs.MAX_MEMORY, "16M")
    try:
        validate(True)
    except ValueError as exc:
        assert envs.MAX_MEMORY in str(exc)
    else:
        raise AssertionError("the premise: vLLM refuses the unregistered variable")
    envs.register_with_vllm(vllm.envs.environment_variables)
    validate(True)
