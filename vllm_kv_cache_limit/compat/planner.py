"""The vLLM functions ``vllm-kv-plan`` calls (it wraps none), and the one
difference across the window it handles here.
"""

from __future__ import annotations

from vllm_kv_cache_limit.compat import registry
from vllm_kv_cache_limit.compat.entries import Hook

PLANNER_APIS: tuple[Hook, ...] = (
    Hook(("vllm.engine.arg_utils",), "EngineArgs.create_engine_config", ("self",)),
    Hook(("vllm.model_executor.layers.attention.attention",), "Attention.get_kv_cache_spec"),
    # How a worker customizes an attention layer's KV cache spec (one
    # difference across the window; see customize_attention_spec below).
    Hook(("vllm.v1.worker.utils",), "customize_attention_spec", versions=">=0.32"),
    Hook(("vllm.v1.attention.backend",), "AttentionBackend.customize_spec", ("cls", "spec"), versions="<0.32"),
    Hook(("vllm.distributed.kv_transfer.kv_connector.utils",), "get_current_attn_backends"),
    Hook(("vllm.v1.attention.backends.utils",), "get_supported_kv_cache_layouts"),
    Hook(("vllm.v1.attention.backends.utils",), "resolve_kv_cache_layout"),
    Hook(("vllm.distributed.utils",), "get_pp_indices"),
    Hook(("vllm.config.vllm",), "set_current_vllm_config"),
    Hook(("vllm.utils.torch_utils",), "set_default_torch_dtype"),
    Hook(("vllm.utils.torch_utils",), "kv_cache_dtype_str_to_dtype"),
    Hook(("vllm.v1.core.single_type_kv_cache_manager",), "register_all_kvcache_specs"),
    Hook(
        ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"),
        "get_kv_cache_configs",
        ("vllm_config", "kv_cache_specs", "available_memory"),
    ),
)
"""vLLM functions ``vllm-kv-plan`` calls (it wraps none): checked by
``scripts/check_hooks.py`` beside ``HOOKS``, but never at engine start-up,
since the cap does not depend on them. ``plan.introspect`` finds each one
here (a test ties the two); vLLM 0.33's ``get_global_kv_cache_groups`` is
looked up in the modules of ``get_kv_cache_configs``."""


def customize_attention_spec(backend: object, spec: object) -> object:
    """The KV cache spec a worker uses for an attention layer's ``spec`` on
    ``backend``. vLLM >= 0.32: ``vllm.v1.worker.utils.customize_attention_spec``;
    0.29-0.31: the backend's ``customize_spec``, which their workers call
    directly."""
    try:
        from vllm.v1.worker.utils import customize_attention_spec as customize
    except ImportError:  # vLLM < 0.32
        return backend.customize_spec(spec)  # type: ignore[attr-defined]
    return customize(backend, spec)


def get_hook(qualname: str, hooks: tuple[Hook, ...] | None = None) -> Hook:
    """The entry for ``qualname`` in ``hooks`` (default: ``HOOKS``; the
    planner looks up ``PLANNER_APIS``)."""
    for hook in registry.cap_hooks() if hooks is None else hooks:
        if hook.qualname == qualname:
            return hook
    raise KeyError(qualname)
