"""Which vLLM versions the plugin supports, and every place it touches vLLM.

* ``entries``: :class:`Hook` (a function wrapped or called) and
  :class:`Attribute` (an attribute relied on);
* ``registry``: every hook, declared beside its wrapper in ``hooks.cap`` and
  ``hooks.runtime``; ``attributes``: every attribute; ``planner``: what
  ``vllm-kv-plan`` calls;
* ``live``: the checks against the imported vLLM (at start-up, when a cap is
  set); ``source_check``: the same against a vLLM source tree without
  importing it (CI reads the CUDA builds' wheels this way);
* ``versions``: the supported range and the drift error; ``tables``: the
  generated docs tables; ``utilization``: ``--gpu-memory-utilization`` as
  the installed vLLM resolves it.

Importing this package imports no vLLM.
"""

from __future__ import annotations

from vllm_kv_cache_limit.compat.attributes import ATTRIBUTES, RESIZE_ATTRIBUTES
from vllm_kv_cache_limit.compat.entries import Attribute, Hook, for_version
from vllm_kv_cache_limit.compat.live import (
    check_attributes,
    check_attributes_at_startup,
    check_hooks,
    check_hooks_at_startup,
    class_has_attribute,
    resolve_hook,
)
from vllm_kv_cache_limit.compat.planner import PLANNER_APIS, customize_attention_spec, get_hook
from vllm_kv_cache_limit.compat.source_check import check_attributes_in_source, check_hooks_in_source
from vllm_kv_cache_limit.compat.tables import attributes_table, hooks_table
from vllm_kv_cache_limit.compat.utilization import gpu_memory_utilization, set_gpu_memory_utilization
from vllm_kv_cache_limit.compat.versions import (
    SUPPORTED_VLLM,
    drift_message,
    installed_vllm_version,
    require_vllm,
    stop_if_capped,
    supported,
    version_supported,
)

__all__ = [
    "ATTRIBUTES",
    "HOOKS",
    "PLANNER_APIS",
    "RESIZE_ATTRIBUTES",
    "RESIZE_HOOKS",
    "SUPPORTED_VLLM",
    "Attribute",
    "Hook",
    "attributes_table",
    "check_attributes",
    "check_attributes_at_startup",
    "check_attributes_in_source",
    "check_hooks",
    "check_hooks_at_startup",
    "check_hooks_in_source",
    "class_has_attribute",
    "customize_attention_spec",
    "drift_message",
    "stop_if_capped",
    "supported",
    "for_version",
    "get_hook",
    "gpu_memory_utilization",
    "hooks_table",
    "installed_vllm_version",
    "require_vllm",
    "resolve_hook",
    "set_gpu_memory_utilization",
    "version_supported",
]


HOOKS: tuple[Hook, ...]
"""Every hook of the cap (``registry.cap_hooks()``), loaded on first use."""
RESIZE_HOOKS: tuple[Hook, ...]
"""Every hook of run-time resize (``registry.resize_hooks()``), loaded on first use."""


def __getattr__(name: str) -> object:
    # The hook tables come from the registry, whose modules import vLLM: on first use only.
    from vllm_kv_cache_limit.compat import registry

    if name == "HOOKS":
        return registry.cap_hooks()
    if name == "RESIZE_HOOKS":
        return registry.resize_hooks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
