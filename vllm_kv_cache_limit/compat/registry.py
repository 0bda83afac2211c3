"""One registry of every hook: each is declared once, beside its wrapper, in
the module of ``hooks.cap`` (the cap) or ``hooks.runtime`` (run-time resize) named
after the vLLM module it patches, as that module's ``HOOKS``; the module's
``TARGETS`` says which vLLM module's import runs which of its ``patch``
functions. The start-up checks, ``make check-hooks``, the generated docs
table and ``_bootstrap``'s module map (a test derives it from here) all come
from this registry.

Importing it is cheap: the hook modules, which import vLLM, load on the
first call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kv_cache_limit.compat.entries import Hook

CAP_MODULES = (
    "hooks.cap.arg_utils",
    "hooks.cap.engine_core",
    "hooks.cap.engine_utils",
    "hooks.cap.compilation",
    "hooks.cap.gpu_worker",
    "hooks.cap.cpu_worker",
    "hooks.devices",
    "hooks.cap.ranks",
)
"""The modules of the cap's hooks (a failing one stops a capped start-up)."""
RESIZE_MODULES = (
    "hooks.runtime.block_pool",
    "hooks.runtime.engine_core",
    "hooks.runtime.limit",
    "hooks.runtime.worker",
    "hooks.runtime.client",
    "hooks.runtime.server",
)
"""The modules of run-time resize's hooks (optional: one that does not fit
makes resizing refuse, never start-up)."""


def modules(names: tuple[str, ...]) -> list[ModuleType]:
    """The hook modules named (relative to the package), imported."""
    return [importlib.import_module(f"vllm_kv_cache_limit.{name}") for name in names]


def cap_hooks() -> tuple[Hook, ...]:
    """Every hook of the cap, in module order."""
    return tuple(hook for module in modules(CAP_MODULES) for hook in module.HOOKS)


def resize_hooks() -> tuple[Hook, ...]:
    """Every hook of run-time resize, in module order."""
    return tuple(hook for module in modules(RESIZE_MODULES) for hook in module.HOOKS)


def targets() -> dict[str, tuple[Callable[[Any], None], ...]]:
    """vLLM module -> the patch functions its import runs, cap first."""
    found: dict[str, tuple[Callable[[Any], None], ...]] = {}
    for module in modules(CAP_MODULES + RESIZE_MODULES):
        for target, patch in module.TARGETS.items():
            found[target] = (*found.get(target, ()), patch)
    return found
