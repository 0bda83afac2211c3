"""vllm-kv-cache-limit: a hard upper limit on vLLM's KV cache memory.

``vllm serve MODEL --kv-cache-max-memory 8G`` or
``LLM(model, kv_cache_max_memory="8G")``. This package is a vLLM general
plugin; importing it is cheap and imports no vLLM module.
"""

from __future__ import annotations

# No `typing` import: it costs more than the rest of the start-up hook.

__all__ = [
    "KVCacheMaxMemoryError",
    "KVCacheResizeError",
    "KVCacheResizeFailed",
    "__version__",
    "async_kv_cache_limit_status",
    "async_set_kv_cache_max_memory",
    "format_size",
    "kv_cache_limit_status",
    "parse_size",
    "register",
    "set_kv_cache_max_memory",
]

# The start-up hook imports this package in every interpreter of the
# environment, so the public names load on first use only.
_LAZY = {
    "KVCacheMaxMemoryError": "vllm_kv_cache_limit.logic.errors",
    "format_size": "vllm_kv_cache_limit.logic.sizes",
    "parse_size": "vllm_kv_cache_limit.logic.sizes",
    "KVCacheResizeError": "vllm_kv_cache_limit.logic.errors",
    "KVCacheResizeFailed": "vllm_kv_cache_limit.logic.errors",
    "set_kv_cache_max_memory": "vllm_kv_cache_limit.hooks.runtime.client",
    "kv_cache_limit_status": "vllm_kv_cache_limit.hooks.runtime.client",
    "async_set_kv_cache_max_memory": "vllm_kv_cache_limit.hooks.runtime.client",
    "async_kv_cache_limit_status": "vllm_kv_cache_limit.hooks.runtime.client",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

_registered = False


def register() -> None:
    """vLLM general plugin entry point (group ``vllm.general_plugins``).

    vLLM calls it in every process, possibly more than once; the hooks are
    installed once per process.
    """
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_kv_cache_limit import _bootstrap, compat

    version = compat.require_vllm()
    if not compat.version_supported(version):
        import logging

        logging.getLogger("vllm.plugins.kv_cache_limit").warning(
            "vllm-kv-cache-limit supports vLLM %s; installed: %s. Its hooks are "
            "checked when --kv-cache-max-memory is used.",
            compat.SUPPORTED_VLLM[1],
            version,
        )
    _bootstrap.install()
