"""One registry of every hook: each is declared once, beside its wrapper, in
the module of ``hooks.cap`` (the cap) or ``hooks.runtime`` (run-time resize) named
after the vLLM module it patches, as that module's ``HOOKS`` (and the vLLM
functions ``vllm-kv-sim`` calls, in ``sim/``); the module's
``TARGETS`` says which vLLM module's import runs which of its ``patch``
functions. A module is registered by being there: the lists below are read
from the tree. The start-up checks, ``make check-hooks``, the generated docs
table and ``_bootstrap``'s module map (a test derives it from here) all come
from this registry.

Importing it is cheap: the hook modules, which import vLLM, load on the
first call.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kv_cache_limit.compat.entries import Attribute, Hook


def _declaring(package: str) -> tuple[str, ...]:
    """The modules of ``package`` (dotted, relative to this package) that
    declare hooks, a ``HOOKS`` tuple at module level, sorted; found in their
    source, so nothing is imported."""
    folder = Path(__file__).resolve().parents[1].joinpath(*package.split("."))
    return tuple(
        f"{package}.{path.stem}"
        for path in sorted(folder.glob("*.py"))
        if path.stem != "__init__" and re.search(r"^HOOKS = \(", path.read_text(encoding="utf-8"), re.MULTILINE)
    )


CAP_MODULES = _declaring("hooks") + _declaring("hooks.cap")
"""The modules of the cap's hooks (a failing one stops a capped start-up):
``hooks/cap/`` and the helpers beside it in ``hooks/``."""
RESIZE_MODULES = _declaring("hooks.runtime")
"""The modules of run-time resize's hooks, ``hooks/runtime/`` (optional: one
that does not fit makes resizing refuse, never start-up)."""


SIM_MODULES = _declaring("sim")
"""The modules of ``vllm-kv-sim`` that record the vLLM functions and fields
it uses (``HOOKS``, ``ATTRIBUTES``; it wraps none). Checked against every
wheel beside the plugin's hooks, never part of a start-up: the plugin
imports no simulator (only :func:`sim_hooks` and :func:`sim_attributes`
load these modules, which import no vLLM)."""


def modules(names: tuple[str, ...]) -> list[ModuleType]:
    """The hook modules named (relative to the package), imported."""
    return [importlib.import_module(f"vllm_kv_cache_limit.{name}") for name in names]


def cap_hooks() -> tuple[Hook, ...]:
    """Every hook of the cap, in module order."""
    return tuple(hook for module in modules(CAP_MODULES) for hook in module.HOOKS)


def resize_hooks() -> tuple[Hook, ...]:
    """Every hook of run-time resize, in module order."""
    return tuple(hook for module in modules(RESIZE_MODULES) for hook in module.HOOKS)


def sim_hooks() -> tuple[Hook, ...]:
    """Every vLLM function and constructor ``vllm-kv-sim`` calls."""
    return tuple(hook for module in modules(SIM_MODULES) for hook in module.HOOKS)


def sim_attributes() -> tuple[Attribute, ...]:
    """Every field of a vLLM object ``vllm-kv-sim`` reads or sets."""
    return tuple(attribute for module in modules(SIM_MODULES) for attribute in getattr(module, "ATTRIBUTES", ()))


def targets() -> dict[str, tuple[Callable[[Any], None], ...]]:
    """vLLM module -> the patch functions its import runs, cap first."""
    found: dict[str, tuple[Callable[[Any], None], ...]] = {}
    for module in modules(CAP_MODULES + RESIZE_MODULES):
        for target, patch in module.TARGETS.items():
            found[target] = (*found.get(target, ()), patch)
    return found
