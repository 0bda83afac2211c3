"""vllm.v1.engine.core_client: the Python API of run-time resize, for ``LLM``
and ``AsyncLLM`` (the client side of the engine cores' utility methods), and
the in-process client's calls kept apart from its engine core's autoscaling.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.runtime.availability import (
    RESIZE_REMOVE,
    RESIZE_UPSTREAM,
    optional,
    problem_of,
    require_hooks,
)
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic import limit_math
from vllm_kv_cache_limit.logic.errors import KVCacheResizeError, KVCacheResizeFailed
from vllm_kv_cache_limit.logic.sizes import format_size

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


POLL_S = 0.05


def _client(engine: Any) -> Any:
    require_hooks()  # the client's attributes too (compat.RESIZE_ATTRIBUTES)
    engine = getattr(engine, "llm_engine", engine)  # LLM -> LLMEngine
    return engine.engine_core


def _call(engine: Any, method: str, *args: Any) -> dict[str, Any]:
    client = _client(engine)
    if hasattr(client, "call_utility"):
        result = client.call_utility(method, *args)
    else:  # InprocClient: the engine core lives in this process
        with _engine_lock(client.engine_core):
            result = getattr(client.engine_core, method)(*args)
    return _checked(result)


def _engine_lock(engine_core: Any) -> contextlib.AbstractContextManager[Any]:
    """The autoscaling lock of an in-process engine core (none without autoscaling)."""
    state = EngineCoreState.peek(engine_core)
    lock = None if state is None else state.lock
    return contextlib.nullcontext() if lock is None else lock


async def _call_async(engine: Any, method: str, *args: Any) -> dict[str, Any]:
    client = _client(engine)
    engines = list(client.core_engines)  # every AsyncLLM client is an MPClient
    if len(engines) < 2:
        return _checked(await client.call_utility_async(method, *args))
    # Data parallel: every engine core has its own scheduler and workers, and
    # vLLM's client sends a utility call to one of them (or to all, keeping
    # the first reply). Each gets the call, and the replies are merged.
    problem = problem_of(ASYNC_MP_CLIENT_CALL_UTILITY_ASYNC)
    if problem:
        raise KVCacheResizeError(f"Run-time KV cache resize with data parallel is unavailable in this vLLM: {problem}")

    async def each(call: str, *values: Any) -> list[Any]:
        return await asyncio.gather(*(client._call_utility_async(call, *values, engine=e) for e in engines))

    before = [_checked(s) for s in await each("kv_cache_limit_status")] if method == "kv_cache_limit_set" else []
    replies = await each(method, *args)
    restore = limit_math.restore_targets(before, replies) if before else []
    if restore:
        # Refused or failed on some engine cores: those that took the change
        # go back to the limit they had, so the engine keeps one limit.
        await asyncio.gather(*(_restore(client, engines, *target) for target in restore))
        refused = [index for index, reply in enumerate(replies) if limit_math.is_error(reply)]
        worst = max((replies[index] for index in refused), key=lambda reply: bool(reply.get("failed")))
        raise _exception(
            {
                **worst,
                "error": f"{worst['error']} (data-parallel engine cores {refused}; "
                "the others were set back to the limit they had)",
            }
        )
    return limit_math.merged([_checked(reply) for reply in replies])


async def _restore(client: Any, engines: list[Any], index: int, size: int, mode: str) -> None:
    reply = await client._call_utility_async("kv_cache_limit_set", size, mode, engine=engines[index])
    if limit_math.is_error(reply):
        logger.warning(
            "Data-parallel engine core %d took the KV cache limit change and could not be set back to %s: %s",
            index,
            format_size(size),
            reply["error"],
        )


def _checked(result: Any) -> dict[str, Any]:
    if limit_math.is_error(result):
        raise _exception(result)
    return dict(result)


def _exception(reply: dict[str, Any]) -> KVCacheResizeError | KVCacheResizeFailed:
    """The error an engine core's ``{"error": ...}`` reply is raised as."""
    return (KVCacheResizeFailed if reply.get("failed") else KVCacheResizeError)(reply["error"])


def _arguments(size: object, mode: object, timeout_s: object) -> tuple[int, str, float]:
    return limit_math.parse_target(size), limit_math.parse_mode(mode), limit_math.parse_timeout(timeout_s)


def set_kv_cache_max_memory(llm: Any, size: int | str, mode: str = "drain", timeout_s: float = 60.0) -> dict[str, Any]:
    """Change the KV cache limit of a running ``LLM`` (per worker, within
    what it allocated at start-up); returns when the limit holds, or at the
    timeout with the status so far (``holds`` says which)."""
    nbytes, mode, timeout_s = _arguments(size, mode, timeout_s)
    status = _call(llm, "kv_cache_limit_set", nbytes, mode)
    deadline = time.monotonic() + timeout_s
    while not status["holds"] and time.monotonic() < deadline:
        time.sleep(POLL_S)
        status = _call(llm, "kv_cache_limit_status")
    return status


def kv_cache_limit_status(llm: Any) -> dict[str, Any]:
    """The KV cache limit in force on a running ``LLM`` and its blocks."""
    return _call(llm, "kv_cache_limit_status")


async def async_set_kv_cache_max_memory(
    engine: Any, size: int | str, mode: str = "drain", timeout_s: float = 60.0
) -> dict[str, Any]:
    """:func:`set_kv_cache_max_memory` for an ``AsyncLLM``."""
    nbytes, mode, timeout_s = _arguments(size, mode, timeout_s)
    status = await _call_async(engine, "kv_cache_limit_set", nbytes, mode)
    deadline = time.monotonic() + timeout_s
    while not status["holds"] and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        status = await _call_async(engine, "kv_cache_limit_status")
    return status


async def async_kv_cache_limit_status(engine: Any) -> dict[str, Any]:
    """:func:`kv_cache_limit_status` for an ``AsyncLLM``."""
    return await _call_async(engine, "kv_cache_limit_status")


async def async_announce_status_url(engine: Any, url: str) -> None:
    """Tell every engine core of an ``AsyncLLM`` where its status is read
    (written into its entry in the lock folder, ``hooks.runtime.engine_entry``)."""
    client = _client(engine)
    engines = list(getattr(client, "core_engines", None) or [])
    if len(engines) < 2:
        await client.call_utility_async("kv_cache_limit_announce", url)
        return
    await asyncio.gather(*(client._call_utility_async("kv_cache_limit_announce", url, engine=e) for e in engines))


def patch(module: Any) -> None:
    """Why: an autoscaled engine core in the caller's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no input queue to wake; while
    the caller makes no call, a timer decides its limit in a thread of its
    own, and nothing the client asks of the engine core may run during such
    a decision. How: wraps every public method ``InprocClient`` defines
    (each calls into its engine core) to hold the engine core's autoscaling
    lock. Without autoscaling (no lock) the original runs alone."""
    optional(INPROC_CLIENT, functools.partial(_hold_engine_lock, module.InprocClient))


def _hold_engine_lock(client_class: type) -> None:
    """Wrap each public method the class itself defines (vLLM adds one now
    and then: none is named here, so none is missed)."""
    for name, value in list(vars(client_class).items()):
        if not name.startswith("_") and inspect.isfunction(value):
            wrap(client_class, name, _holding_engine_lock)


def _holding_engine_lock(original: Callable) -> Callable:
    """The original, run holding its engine core's autoscaling lock when it has one."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = EngineCoreState.peek(getattr(self, "engine_core", None))
        lock = None if state is None else state.lock
        if lock is None:
            return original(self, *args, **kwargs)
        with lock:
            return original(self, *args, **kwargs)

    return method


INPROC_CLIENT = Hook(
    ("vllm.v1.engine.core_client",),
    "InprocClient",
    wrapper=patch,
    upstream=RESIZE_UPSTREAM,
    remove_when=RESIZE_REMOVE,
)

ASYNC_MP_CLIENT_CALL_UTILITY_ASYNC = Hook(
    ("vllm.v1.engine.core_client",), "AsyncMPClient._call_utility_async", ("self", "method")
)

# Called, not wrapped: the plugin's utility methods on the engine cores.
SYNC_MP_CLIENT_CALL_UTILITY = Hook(("vllm.v1.engine.core_client",), "SyncMPClient.call_utility", ("self", "method"))
ASYNC_MP_CLIENT_PUBLIC_CALL_UTILITY_ASYNC = Hook(
    ("vllm.v1.engine.core_client",), "AsyncMPClient.call_utility_async", ("self", "method")
)

HOOKS = (
    INPROC_CLIENT,
    ASYNC_MP_CLIENT_CALL_UTILITY_ASYNC,
    SYNC_MP_CLIENT_CALL_UTILITY,
    ASYNC_MP_CLIENT_PUBLIC_CALL_UTILITY_ASYNC,
)

TARGETS: dict[str, Callable[[Any], None]] = {"vllm.v1.engine.core_client": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
