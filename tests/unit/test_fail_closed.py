"""Fail closed in one place (``logic.fail_closed``): one definition of "a cap
is in force", one message, and error classes that say what happened."""

from __future__ import annotations

import pytest

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.logic import envs, fail_closed
from vllm_kv_cache_limit.logic.cap_decision import resolve_cap
from vllm_kv_cache_limit.logic.errors import (
    KVCacheMaxMemoryError,
    KVCacheResizeError,
    KVCacheResizeFailed,
    UnsupportedVLLMError,
)


@pytest.mark.parametrize(
    ("environ", "in_force"),
    [
        ({}, False),
        ({envs.MAX_MEMORY: "  "}, False),  # empty counts as unset, as resolve_cap reads it
        ({envs.MAX_MEMORY: "8G"}, True),
        ({envs.ERROR_FILE: "/run/kvcl/relay"}, True),  # an engine-core or worker process of a capped engine
    ],
)
def test_a_cap_is_in_force_from_the_argument_relay_or_the_environment(environ: dict[str, str], in_force: bool) -> None:
    assert fail_closed.cap_in_force(environ) is in_force


def test_without_a_cap_a_hook_that_does_not_fit_stops_nothing() -> None:
    assert fail_closed.stop_if_capped(["vllm.x.y is missing"], "0.99.0", "0.29-0.34", environ={}) is None


def test_with_a_cap_every_caller_gets_the_same_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    relay = tmp_path / "relay"
    monkeypatch.setenv(envs.ERROR_FILE, str(relay))
    monkeypatch.delenv(envs.MAX_MEMORY, raising=False)
    with pytest.raises(UnsupportedVLLMError) as stopped:
        compat.stop_if_capped(["vllm.v1.engine.core.get_kv_cache_configs is missing"])
    message = str(stopped.value)
    assert message == compat.drift_message(["vllm.v1.engine.core.get_kv_cache_configs is missing"])
    assert message.startswith(
        f"vllm-kv-cache-limit cannot enforce --kv-cache-max-memory on the installed vLLM "
        f"{compat.installed_vllm_version()}; supported vLLM versions: {compat.supported()}."
    )
    assert "Missing or changed hooks or attributes: vllm.v1.engine.core.get_kv_cache_configs is missing" in message
    assert "run without --kv-cache-max-memory" in message
    assert relay.read_text() == message  # handed to the first process


def test_error_classes_say_what_happened() -> None:
    # A user's value: a ValueError, as vLLM raises for its own bad arguments.
    with pytest.raises(KVCacheMaxMemoryError, match="VLLM_KV_CACHE_MAX_MEMORY"):
        resolve_cap(None, "8 gigs")
    assert issubclass(KVCacheResizeError, KVCacheMaxMemoryError) and issubclass(KVCacheMaxMemoryError, ValueError)
    # A vLLM that changed: still a cap error, by its own name.
    assert issubclass(UnsupportedVLLMError, KVCacheMaxMemoryError)
    # An internal failure is not the caller's input.
    assert not issubclass(KVCacheResizeFailed, ValueError) and issubclass(KVCacheResizeFailed, RuntimeError)
