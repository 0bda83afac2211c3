"""Fail closed, in one place: when a cap is in force, and what happens when
a hook cannot enforce it. With a cap in force start-up stops with one error
naming every hook that does not fit; without one, the caller leaves vLLM
untouched. Pure: no vLLM import (the start-up finder in ``_bootstrap`` calls
it while a vLLM module is being imported)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import UnsupportedVLLMError
from vllm_kv_cache_limit.logic.relay import raise_cap_error


def cap_in_force(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process belongs to an engine started with a cap: an
    engine-core or worker process of one (the error relay is armed), or any
    process with ``VLLM_KV_CACHE_MAX_MEMORY`` set. The first process of an
    engine capped by its argument finds out in ``create_engine_config``,
    which checks every hook before any engine process starts."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(envs.ERROR_FILE) or environ.get(envs.MAX_MEMORY, "").strip())


def unenforceable(problems: list[str], version: str, supported: str) -> str:
    """The one error for hooks that do not fit or could not be installed."""
    return (
        f"vllm-kv-cache-limit cannot enforce --kv-cache-max-memory on the installed vLLM {version}; "
        f"supported vLLM versions: {supported}. Missing or changed hooks or attributes: "
        + "; ".join(problems)
        + ". Install a supported vLLM or an updated vllm-kv-cache-limit, or run without "
        "--kv-cache-max-memory (and VLLM_KV_CACHE_MAX_MEMORY)."
    )


def stop_if_capped(problems: list[str], version: str, supported: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`UnsupportedVLLMError` (handed to the first process from
    an engine-core or worker process) when a cap is in force; return
    otherwise, and the caller leaves vLLM untouched."""
    if cap_in_force(environ):
        raise_cap_error(unenforceable(problems, version, supported), UnsupportedVLLMError)
