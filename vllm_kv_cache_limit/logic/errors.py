"""The plugin's errors, in one place. Pure: no vLLM import."""

from __future__ import annotations

__all__ = ["KVCacheMaxMemoryError", "KVCacheResizeError", "KVCacheResizeFailed", "UnsupportedVLLMError"]


class KVCacheMaxMemoryError(ValueError):
    """``kv_cache_max_memory`` cannot be honoured: a value the user gave
    (a size, a setting that conflicts with it) or what the device has."""


class UnsupportedVLLMError(KVCacheMaxMemoryError):
    """The installed vLLM changed where the plugin hooks it, so a cap in
    force cannot be enforced (start-up stops: fail closed)."""


class KVCacheResizeError(KVCacheMaxMemoryError):
    """A run-time limit that cannot be applied; the engine is left as it was."""


class KVCacheResizeFailed(RuntimeError):
    """A run-time change that failed inside vLLM, not because of the
    caller's input (an internal failure); the old limit was restored."""
