"""The plugin's errors, in one place. Pure: no vLLM import."""

from __future__ import annotations

__all__ = ["KVCacheMaxMemoryError", "KVCacheResizeError", "KVCacheResizeFailed"]


class KVCacheMaxMemoryError(ValueError):
    """``kv_cache_max_memory`` cannot be honoured on this device."""


class KVCacheResizeError(KVCacheMaxMemoryError):
    """A run-time limit that cannot be applied; the engine is left as it was."""


class KVCacheResizeFailed(KVCacheResizeError):
    """A change that failed inside vLLM (not the caller's input); the old
    limit was restored."""
