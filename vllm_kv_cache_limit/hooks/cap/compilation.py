"""vllm.config.compilation: hybrid (Mamba) models with full CUDA graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_kv_cache_limit.compat import Hook
from vllm_kv_cache_limit.hooks.apply import hook_ok, name_cap_when_refused
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.hooks.wrap import wrap
from vllm_kv_cache_limit.logic.cap_decision import mamba_blocks_message
from vllm_kv_cache_limit.logic.kv_cache import bytes_per_block


def patch(module: Any) -> None:
    """Why: with full CUDA graphs, vLLM needs a KV cache block per decoding
    sequence of a hybrid (Mamba) model and otherwise tells the user to raise
    ``gpu_memory_utilization``; under a binding cap that advice is wrong.
    How: wraps ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` (run in
    each worker once the KV cache is sized); when it refuses and the cap
    made the block count too small, raises an error naming the cap."""
    if hook_ok(COMPILATION_CONFIG_RESOLVE_CUDAGRAPH_MODE_AND_SIZES):
        wrap(module.CompilationConfig, "resolve_cudagraph_mode_and_sizes", _name_cap_when_mamba_blocks_short)


def _name_cap_when_mamba_blocks_short(original: Callable) -> Callable:
    return name_cap_when_refused(original, _mamba_blocks_message)


def _mamba_blocks_message(arguments: dict[str, Any]) -> str | None:
    state = WorkerState.peek(arguments["self"])  # the compilation config of a capped worker's engine
    decision = None if state is None else state.cap_decision
    kv_cache_config, max_num_reqs = arguments.get("kv_cache_config"), arguments.get("max_num_reqs")
    if (
        decision is None
        or not decision.bound
        or kv_cache_config is None
        or max_num_reqs is None
        or not kv_cache_config.has_mamba_layers
        or max_num_reqs <= kv_cache_config.num_blocks
    ):
        return None
    return mamba_blocks_message(
        decision.cap, kv_cache_config.num_blocks, max_num_reqs, bytes_per_block(kv_cache_config)
    )


COMPILATION_CONFIG_RESOLVE_CUDAGRAPH_MODE_AND_SIZES = Hook(
    ("vllm.config.compilation",),
    "CompilationConfig.resolve_cudagraph_mode_and_sizes",
    # kv_cache_config and max_num_reqs are read by name (0.29-0.31 put
    # tensor_parallel_size before them).
    ("self", "min_cg_support", "min_cg_attn_backend"),
    wrapper=_name_cap_when_mamba_blocks_short,
    upstream="none yet: vLLM's message naming the cap",
    remove_when="vLLM applies the cap (the message follows)",
)

HOOKS = (COMPILATION_CONFIG_RESOLVE_CUDAGRAPH_MODE_AND_SIZES,)

TARGETS = {"vllm.config.compilation": patch}
"""vLLM module -> the function here that patches it once the module has loaded (``_bootstrap``)."""
