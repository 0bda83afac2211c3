"""Every environment variable the plugin reads, named once.

The variables a user sets carry vLLM's ``VLLM_`` prefix. vLLM checks every
``VLLM_*`` variable against ``vllm.envs.environment_variables`` when it
builds an engine config (``Platform.validate_environ``: a warning, or an
error with ``--fail-on-environ-validation``), so :func:`register_with_vllm`
adds those that are set before it checks. The values the plugin hands to
its own child processes carry no ``VLLM_`` prefix: vLLM never reads them.

Pure: no vLLM import (the start-up hook imports this module).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # no `typing` import: the start-up hook imports this module
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping
    from typing import Any

MAX_MEMORY = "VLLM_KV_CACHE_MAX_MEMORY"
"""The cap, when ``--kv-cache-max-memory`` is not given."""
STARTUP_LOCK = "VLLM_KV_CACHE_LIMIT_STARTUP_LOCK"
"""``0`` turns the start-up lock off."""
LOCK_DIR = "VLLM_KV_CACHE_LIMIT_LOCK_DIR"
"""The folder of the start-up lock files."""
LOCK_TIMEOUT = "VLLM_KV_CACHE_LIMIT_LOCK_TIMEOUT"
"""Seconds to wait for a device's start-up lock."""

SHRINK_AFTER_S = "VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S"
"""Seconds an autoscaled engine's demand must stay below its limit before it shrinks."""

LAZY_RELEASE = "VLLM_KV_CACHE_LIMIT_LAZY_RELEASE"
"""``0``: an autoscaled engine that shrinks after idling returns its pages at
once (``MADV_DONTNEED``), as every other release does, instead of lazily
(``MADV_FREE``)."""

USER_VARIABLES = (MAX_MEMORY, STARTUP_LOCK, LOCK_DIR, LOCK_TIMEOUT, SHRINK_AFTER_S, LAZY_RELEASE)
"""The variables a user sets (docs/kv-cache-max-memory.md, docs/sharing-a-device.md, docs/autoscale.md)."""

ERROR_FILE = "KV_CACHE_LIMIT_ERROR_FILE"
"""Internal: set in the first process when a cap is given; an engine-core or
worker process writes its cap error there, so that the first process raises
it instead of vLLM's generic "Engine core initialization failed"."""
INACTIVE_WARNED = "KV_CACHE_LIMIT_INACTIVE_WARNED"
"""Internal: set once the "plugin is inactive" warning was logged in this
process tree."""


def _reader(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


def register_with_vllm(
    environment_variables: MutableMapping[str, Callable[[], Any]], environ: Mapping[str, str] = os.environ
) -> list[str]:
    """Add the plugin's variables that are set in ``environ`` to vLLM's
    ``environment_variables`` (name -> reader), so that vLLM's check of
    ``VLLM_*`` variables accepts them; returns the names added. Unset ones
    are left out: without them vLLM's table stays as vLLM made it."""
    added = []
    for name in USER_VARIABLES:
        if name in environ and name not in environment_variables:
            environment_variables[name] = _reader(name)
            added.append(name)
    return added


def seconds(
    name: str, default: float, example: str, meaning: str, environ: Mapping[str, str] = os.environ, finite: bool = True
) -> float:
    """A number of seconds, zero or more, from variable ``name`` (``default``
    when unset or empty); ``ValueError`` quoting a bad value, with an
    ``example`` of a good one and what it means."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf") if finite else value >= 0):
        raise ValueError(f"{name}={raw!r} is not a number of seconds; use for example {name}={example} ({meaning}).")
    return value
