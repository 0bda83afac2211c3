"""How vLLM's model implementations build their attention layers, per
architecture: the head size and the sliding window of each layer the
planner's KV cache specs need (read in each model's vLLM source, named in
each function). No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _window_from_layer_types(hf_config: Any, layer: int) -> int | None:
    # llama.py, gemma2.py: a layer slides when layer_types says so; a
    # model-level sliding_window without layer_types is not applied.
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and layer_types[layer] == "sliding_attention":
        return hf_config.sliding_window
    return None


def _no_window(hf_config: Any, layer: int) -> int | None:
    # qwen2.py, qwen3.py, mixtral.py: the attention layers get no sliding
    # window, whatever the config holds.
    return None


def _config_head_size(model_config: Any) -> int:
    return model_config.get_head_size()


def _qwen2_head_size(model_config: Any) -> int:
    # qwen2.py: head_dim = hidden_size // num_attention_heads, whatever
    # head_dim the config holds.
    hf = model_config.hf_text_config
    return hf.hidden_size // hf.num_attention_heads


@dataclass(frozen=True)
class _Recipe:
    """How a vLLM model implementation builds its attention layers."""

    window: Callable[[Any, int], int | None] = _window_from_layer_types
    head_size: Callable[[Any], int] = _config_head_size


EXACT_ARCHITECTURES: dict[str, _Recipe] = {
    "LlamaForCausalLM": _Recipe(),
    "MistralForCausalLM": _Recipe(),
    "Gemma2ForCausalLM": _Recipe(),
    "Qwen2ForCausalLM": _Recipe(window=_no_window, head_size=_qwen2_head_size),
    "Qwen3ForCausalLM": _Recipe(window=_no_window),
    "MixtralForCausalLM": _Recipe(window=_no_window),
}
"""vLLM architectures whose attention layers the planner builds exactly as
their vLLM implementation does. Others with plain attention layers are
planned the same way and labelled as an estimate."""


# ---------------------------------------------------------------------------
# Input checks and vLLM's configuration
# ---------------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_cache_dtype_name(cache_dtype: str, worker_specs: list[dict[str, Any]]) -> str:
    """``--kv-cache-dtype auto`` resolved to what the layers store."""
    if cache_dtype != "auto":
        return cache_dtype
    names = sorted({_dtype_name(spec.dtype) for stage in worker_specs for spec in stage.values()})
    return "/".join(names)
