"""Whether run-time resizing can work in this vLLM: every resize hook is
optional, one that could not be applied (or a function or attribute that
does not fit) makes resizing refuse, naming it, and leaves start-up alone.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.logic.errors import KVCacheResizeError

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


RESIZE_UPSTREAM = "none yet: a resizable KV cache (vllm #18125 asks for it; sleep mode is all-or-nothing)"
RESIZE_REMOVE = "vLLM can change its KV cache size at run time"

unavailable: dict[str, str] = {}
"""Resize hook -> why it could not be applied; resizing then refuses. A fact
about this process's vLLM, not about an engine."""

_called_checked = False


def problem_of(hook: Hook) -> str | None:
    """What does not fit in this vLLM for ``hook`` (None: it fits)."""
    return compat.resolve_hook(hook)[1]


def optional(hook: Hook, apply: Callable[[], None]) -> None:
    """Apply one resize hook; on any failure record it (resizing then refuses
    naming it) and go on: resizing never stops start-up."""
    try:
        problem = problem_of(hook)
        if problem:
            raise LookupError(problem)
        apply()
    except Exception as exc:
        unavailable[hook.qualname] = f"{hook.qualname}: {exc}"
        logger.warning("Run-time KV cache resize is unavailable: %s could not be applied (%s).", hook.qualname, exc)


def require_hooks() -> None:
    """Refuse, naming each, when a resize hook could not be applied or a
    function or attribute resizing relies on does not fit this vLLM (checked
    once per process: in the engine core, and in the client's process)."""
    global _called_checked
    if not _called_checked:
        _called_checked = True
        from vllm_kv_cache_limit.compat import registry

        for hook in compat.for_version(registry.resize_hooks(), compat.installed_vllm_version()):
            if hook.wrapper is None and (problem := problem_of(hook)):  # called, not wrapped
                unavailable[hook.qualname] = f"{hook.qualname}: {problem}"
        for problem in compat.check_attributes_at_startup(compat.attributes.RESIZE_ATTRIBUTES):
            unavailable[problem] = problem
    if unavailable:
        raise KVCacheResizeError(
            "Run-time KV cache resize is unavailable in this vLLM: " + "; ".join(sorted(unavailable.values()))
        )
