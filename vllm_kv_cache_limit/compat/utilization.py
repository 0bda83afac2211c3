"""``--gpu-memory-utilization`` as vLLM applies it, across releases. No vLLM
import.

vLLM 0.29-0.33: ``CacheConfig.gpu_memory_utilization`` is a float (0.9 by
default). vLLM 0.34: the field defaults to None and vLLM reads the property
``resolved_gpu_memory_utilization`` (the field when set; else 1.0 with the
extensible KV cache, else 0.92).
"""

from __future__ import annotations

from typing import Any

RESOLVED = "resolved_gpu_memory_utilization"
"""vLLM 0.34's property: the utilization its gates and sizing read."""


def gpu_memory_utilization(cache_config: Any) -> float:
    """The utilization vLLM sizes with: the resolved value where vLLM has one
    (0.34+, whose field may be None), else the field."""
    if isinstance(getattr(type(cache_config), RESOLVED, None), property):
        return float(getattr(cache_config, RESOLVED))
    return float(cache_config.gpu_memory_utilization)


def set_gpu_memory_utilization(cache_config: Any, utilization: float | None) -> None:
    """Set the utilization vLLM will read. The field, which 0.34's property
    returns whenever it is set; None (0.34's default) gives the resolution
    back to vLLM."""
    cache_config.gpu_memory_utilization = utilization
