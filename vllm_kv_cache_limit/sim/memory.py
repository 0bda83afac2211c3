"""The device's memory: each instance's weights and activations beside the
KV cache the scenario gives it, within the device's total.

- Weights: ``weights=`` per instance, else the plugin's own lower bound
  from the model folder's safetensors headers (``logic/weights.py``, what
  its check before loading counts), else an estimate from ``config.json``
  (a decoder of Llama's shape: embeddings, attention, gated MLP, norms).
- Activations: ``activations=`` per instance, else an estimate of vLLM's
  profiling peak: one step of ``max_num_batched_tokens`` tokens through the
  widest layer (hidden states, q/k/v, the MLP's gate and up projections) and
  the sampler's fp32 logits of ``max_num_seqs`` requests. vLLM's CUDA graphs
  and the CUDA context are not counted: give ``activations=`` to include them.
- ``no-cap``: vLLM's own sizing with ``--gpu-memory-utilization`` U: an
  instance asks for ``U * total``, refuses to start when less is free, and
  gives its KV cache what its weights and activations leave of that.

Pure arithmetic on numbers and the model folder; no vLLM import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.logic.weights import weight_bytes_lower_bound

GiB = 1 << 30
DEVICE_MEMORY = {"h100_sxm": 80 * GiB, "h200_sxm": 141 * GiB, "a100_sxm": 80 * GiB, "b200_sxm": 192 * GiB}
"""``--device-memory``'s default per ``--system`` (used only with aiconfigurator-core's step times)."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class DeviceMemoryError(ValueError):
    """Memory that does not fit the device; the message quotes the values and says what would fit."""


@dataclass(frozen=True)
class Footprint:
    """One instance's memory besides its KV cache, in bytes."""

    name: str
    weights: int
    activations: int

    @property
    def non_kv(self) -> int:
        return self.weights + self.activations


def _config(model: str) -> dict:
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config.get("text_config", config) if isinstance(config, dict) else {}


def _itemsize(config: dict, dtype: str) -> int:
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16" if dtype == "auto" else dtype
    return DTYPE_BYTES.get(str(name).removeprefix("torch."), 2)


def config_weight_bytes(config: dict, itemsize: int) -> int:
    """Parameters of a Llama-shaped decoder from its config, times ``itemsize`` (0 if the config lacks a shape)."""
    try:
        hidden, layers, vocab = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["vocab_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config.get("intermediate_size", 4 * hidden))
    except (KeyError, TypeError, ValueError):
        return 0
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return (embeddings + layers * per_layer + hidden) * itemsize


def activation_bytes(config: dict, itemsize: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An estimate of vLLM's profiling peak besides weights and KV cache (see the module's docstring)."""
    hidden = int(config.get("hidden_size", 0))
    heads = int(config.get("num_attention_heads", 1) or 1)
    head_dim = int(config.get("head_dim") or (hidden // heads if hidden else 0))
    kv_heads = int(config.get("num_key_value_heads", heads))
    inter = int(config.get("intermediate_size", 4 * hidden))
    per_token = 2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * inter
    logits = max_num_seqs * int(config.get("vocab_size", 0)) * 4
    return max_num_batched_tokens * per_token * itemsize + logits


def footprint(spec: Any, weights: int | None = None, activations: int | None = None) -> Footprint:
    """``spec``'s (an ``InstanceSpec``) weights and activations: given, or estimated as the module says."""
    model, dtype = spec.model, spec.dtype
    config = _config(model)
    itemsize = _itemsize(config, dtype)
    if weights is None:
        weights = weight_bytes_lower_bound(model, itemsize) or config_weight_bytes(config, itemsize)
    if activations is None:
        tokens = max(spec.max_num_batched_tokens, spec.max_model_len)
        activations = activation_bytes(config, itemsize, tokens, spec.max_num_seqs)
    return Footprint(spec.name, int(weights), int(activations))


def check_fits(scenario: str, kv_bytes: int, footprints: list[Footprint], total: int | None, what: str) -> None:
    """Refuse a scenario whose KV cache (``kv_bytes`` at start, ``what`` names
    it) and every instance's weights and activations exceed the device's
    ``total``; the error says the largest ``--budget`` that fits."""
    if total is None:
        return
    non_kv = sum(f.non_kv for f in footprints)
    if non_kv + kv_bytes <= total:
        return
    parts = ", ".join(
        f"{f.name}: weights {format_size(f.weights)} + activations {format_size(f.activations)}" for f in footprints
    )
    left = total - non_kv
    fit = (
        f"at most --budget {format_size(left, 'down')} fits beside them"
        if left > 0
        else "the weights and activations alone do not fit: give a larger --device-memory or fewer instances"
    )
    raise DeviceMemoryError(
        f"scenario {scenario}: {what} of {format_size(kv_bytes)} ({kv_bytes} bytes) and the instances' "
        f"{format_size(non_kv)} ({parts}) exceed the device's {format_size(total)} ({total} bytes); {fit}."
    )


def no_cap_kv_bytes(footprints: list[Footprint], total: int, utilization: float) -> list[int | str]:
    """Each instance's KV cache bytes under vLLM's default sizing, started in
    order on the device, or the error vLLM would stop it with (then it holds nothing)."""
    requested = int(total * utilization)
    used = 0
    sizes: list[int | str] = []
    for f in footprints:
        free = total - used
        if free < requested:
            sizes.append(
                f"Free memory on device ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less than desired "
                f"GPU memory utilization ({utilization}, {requested / GiB:.2f} GiB). Decrease GPU memory "
                "utilization or reduce GPU memory used by other processes. (vLLM's error: the instance does not start)"
            )
            continue
        kv = requested - f.non_kv
        if kv <= 0:
            sizes.append(
                "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine. (vLLM's error: the instance does not start)"
            )
            continue
        sizes.append(kv)
        used += requested
    return sizes
