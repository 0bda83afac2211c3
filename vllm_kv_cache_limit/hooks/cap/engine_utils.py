"""vllm.v1.engine.utils: the cap error as the final error of the first process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.apply import hook_ok
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.relay import take_relayed_error


def patch(module: Any) -> None:
    """Why: an error raised in the engine-core process reaches the first
    process only as "Engine core initialization failed. See root cause
    above." How: wraps ``wait_for_engine_startup``; when it fails and an
    engine-core or worker process left a cap error in the relay file, that
    error is raised instead."""
    if hook_ok(WAIT_FOR_ENGINE_STARTUP):
        wrap(module, "wait_for_engine_startup", _raise_relayed_error)


def _raise_relayed_error(original: Callable) -> Callable:
    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except RuntimeError:
            message = take_relayed_error()
            if message:  # vLLM's "See root cause above" adds nothing: the root cause is this
                raise KVCacheMaxMemoryError(message) from None
            raise

    return wait_for_engine_startup


WAIT_FOR_ENGINE_STARTUP = Hook(
    ("vllm.v1.engine.utils",),
    "wait_for_engine_startup",
    wrapper=_raise_relayed_error,
    upstream="none yet: the engine core sending its start-up exception to the client",
    remove_when="vLLM reports the engine core's start-up error itself",
)

HOOKS = (WAIT_FOR_ENGINE_STARTUP,)

TARGETS = {"vllm.v1.engine.utils": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
