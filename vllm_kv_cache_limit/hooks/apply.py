"""Whether a hook fits the imported vLLM, and what happens when it does not:
without a cap, a warning and vLLM untouched; in a process of an engine
started with a cap, the cap error (fail closed).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.cap_decision import (
    FLAG,
)
from vllm_kv_cache_limit.logic.relay import raise_cap_error

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


_inactive_warned = False


def hook_ok(hook: Hook) -> bool:
    """Check one hook against the imported vLLM; when it does not fit, fail
    closed (:func:`unenforced`) and tell the caller to leave vLLM untouched."""
    _, problem = compat.resolve_hook(hook)
    if problem is None:
        return True
    unenforced(problem)
    return False


def unenforced(problem: str) -> None:
    """A hook that cannot be applied: with a cap in force, the error that
    stops start-up (``logic.fail_closed``); without one, a warning once per
    launch, and vLLM runs unchanged."""
    global _inactive_warned
    compat.stop_if_capped([problem])
    if not _inactive_warned and not os.environ.get(envs.INACTIVE_WARNED):
        _inactive_warned = True
        # Engine-core and worker processes inherit this and stay quiet: one
        # warning per launch, from the process the user started.
        os.environ[envs.INACTIVE_WARNED] = "1"
        logger.warning(
            "vllm-kv-cache-limit is inactive: %s (installed vLLM %s; supported: %s). "
            "vLLM runs unchanged; %s would fail.",
            problem,
            compat.installed_vllm_version(),
            compat.SUPPORTED_VLLM[1],
            FLAG,
        )


def name_cap_when_refused(original: Callable, message: Callable[[dict[str, Any]], str | None]) -> Callable:
    """A wrapper around a vLLM check that refuses with ``ValueError`` and
    advice that is wrong under a binding cap: ``message`` gets the call's
    arguments by name and returns the error naming the cap, or None (vLLM's
    own error stands)."""
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except ValueError:
            # The original accepted these arguments, so they bind.
            text = message(signature.bind(*args, **kwargs).arguments)
            if text is None:
                raise
            raise_cap_error(text)

    return wrapper
