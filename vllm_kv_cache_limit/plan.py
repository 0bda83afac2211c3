"""``vllm-kv-plan``: which ``--kv-cache-max-memory`` to pass, computed the way
vLLM computes its own KV cache.

    vllm-kv-plan MODEL [--max-model-len N] [--concurrency C]
                       [--tensor-parallel-size TP] [--pipeline-parallel-size PP]
                       [--kv-cache-dtype D] [--block-size B] [--dtype D]
                       [--max-num-batched-tokens N]
                       [--kv-cache-max-memory SIZE] [--json]

MODEL is a local model folder or a model id already in the local Hugging Face
cache; nothing is downloaded and no weights are loaded. The configuration is
read with vLLM's own ``EngineArgs.create_engine_config``, so the platform's
defaults apply (on the CPU backend: 128-token blocks, a bfloat16 KV cache for a
float32 model). The per-layer KV cache specs come from vLLM's own attention
layers, built as the model's vLLM implementation builds them (heads per
device, head size, sliding window per layer), and vLLM's own planning
(``get_kv_cache_configs``) turns memory into blocks, null block included.

Forward answer: bytes per token and per block, the memory that ``concurrency``
requests of ``max-model-len`` tokens need per device, and the smallest tidy
``--kv-cache-max-memory`` that gives those blocks. Reverse answer (with
``--kv-cache-max-memory``): the blocks, tokens and concurrency a cap gives.
Bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from vllm_kv_cache_limit.policy import ENV_VAR, FLAG
from vllm_kv_cache_limit.sizes import format_size, parse_size

__all__ = [
    "EXACT_ARCHITECTURES",
    "NULL_BLOCKS",
    "KVCachePlan",
    "ModelKVCache",
    "PlanError",
    "build_parser",
    "capacity",
    "load_model_kv_cache",
    "main",
    "make_plan",
    "least_bytes_for",
    "required_blocks",
    "suggest_cap",
]

PROG = "vllm-kv-plan"
EXIT_ERROR = 2

NULL_BLOCKS = 1
"""Blocks vLLM's block pool holds back for good (the null block): counted in
``num_gpu_blocks`` and allocated, but never given to a request."""

_PROBE_BYTES = 1 << 50
"""Memory handed to vLLM's planning to read the block size in bytes: only
numbers are computed, nothing is allocated."""


class PlanError(Exception):
    """Bad input or a question vLLM cannot answer; reported as one line."""


# ---------------------------------------------------------------------------
# Arithmetic (no vLLM): blocks, capacity, the tidy cap
# ---------------------------------------------------------------------------


def required_blocks(blocks_per_request: int, concurrency: int) -> int:
    """Blocks a device needs so that ``concurrency`` requests, each holding
    ``blocks_per_request`` blocks, run at once, plus the null block."""
    if blocks_per_request < 1:
        raise ValueError(f"blocks_per_request must be at least 1, got {blocks_per_request}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    return concurrency * blocks_per_request + NULL_BLOCKS


def capacity(num_blocks: int, blocks_per_request: int, max_model_len: int) -> tuple[int, int, int]:
    """What ``num_blocks`` blocks hold: ``(usable_blocks, tokens,
    max_concurrency)``.

    ``usable_blocks`` leaves out the null block; ``max_concurrency`` is the
    number of requests of ``max_model_len`` tokens that fit at once; ``tokens``
    is the token capacity as vLLM defines it (usable blocks over the blocks of
    one full-length request, times ``max_model_len``). vLLM's own start-up log
    line counts the null block too, so it reports one block more.
    """
    if blocks_per_request < 1:
        raise ValueError(f"blocks_per_request must be at least 1, got {blocks_per_request}")
    usable = max(0, num_blocks - NULL_BLOCKS)
    return usable, usable * max_model_len // blocks_per_request, usable // blocks_per_request


def bytes_per_token(bytes_per_block: int, block_size: int) -> int | float:
    """KV cache bytes per token of one device: an int when the block divides
    evenly (it does for plain attention layers)."""
    whole, rest = divmod(bytes_per_block, block_size)
    return whole if rest == 0 else bytes_per_block / block_size


def least_bytes_for(needed_blocks: int, start: int, blocks_for: Callable[[int], int]) -> int:
    """The fewest bytes that ``blocks_for`` (monotonic) turns into at least
    ``needed_blocks`` blocks, searched from ``start``."""
    if blocks_for(start) >= needed_blocks:
        if start <= 1 or blocks_for(start - 1) < needed_blocks:
            return start
        low, high = 0, start
    else:
        low, high = start, start * 2
        while blocks_for(high) < needed_blocks:
            if high > _PROBE_BYTES:
                raise PlanError(f"no size up to {format_size(high)} gives {needed_blocks} KV cache blocks")
            low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if blocks_for(mid) >= needed_blocks:
            high = mid
        else:
            low = mid
    return high


def suggest_cap(required_bytes: int, needed_blocks: int, blocks_for: Callable[[int], int]) -> tuple[str, int, int]:
    """The smallest tidy size (``format_size(..., "up")``) that gives at least
    ``needed_blocks`` blocks when ``blocks_for`` (the engine's own rounding)
    turns it into blocks. Returns ``(text, bytes, blocks)``."""
    least = least_bytes_for(needed_blocks, required_bytes, blocks_for)
    text = format_size(least, "up")
    nbytes = parse_size(text)
    blocks = blocks_for(nbytes)
    if blocks < needed_blocks:  # blocks_for is not monotonic: a vLLM change
        raise PlanError(
            f"{text} gives {blocks} KV cache blocks under vLLM's rounding, fewer than "
            f"the {needed_blocks} that {least} bytes give"
        )
    return text, nbytes, blocks


# ---------------------------------------------------------------------------
# The model's KV cache, through vLLM
# ---------------------------------------------------------------------------


def _window_from_layer_types(hf_config: Any, layer: int) -> int | None:
    # llama.py, gemma2.py: a layer slides when layer_types says so; a
    # model-level sliding_window without layer_types is not applied.
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types and layer_types[layer] == "sliding_attention":
        return hf_config.sliding_window
    return None


def _no_window(hf_config: Any, layer: int) -> int | None:
    # qwen2.py, qwen3.py: the decoder layers pass no sliding window.
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
}
"""vLLM architectures whose attention layers the planner builds exactly as
their vLLM implementation does. Others with plain attention layers are
planned the same way and labelled as an estimate."""


@dataclass
class ModelKVCache:
    """A model's KV cache as vLLM would plan it on this machine, per device."""

    model: str
    architecture: str
    exact: bool
    estimate_reason: str | None
    vllm_version: str
    platform: str
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_batched_tokens: int
    dtype: str
    kv_cache_dtype: str
    block_size: int
    bytes_per_block: int
    blocks_per_request: int
    num_groups: int = 1
    """vLLM's KV cache groups: a request takes blocks in each."""
    layers: list[dict[str, Any]] = field(default_factory=list)
    blocks_for: Callable[[int], int] = field(default=lambda nbytes: 0, repr=False)
    """Blocks vLLM gives one device for a KV cache budget of ``nbytes``."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_cache_dtype_name(cache_dtype: str, worker_specs: list[dict[str, Any]]) -> str:
    """``--kv-cache-dtype auto`` resolved to what the layers store."""
    if cache_dtype != "auto":
        return cache_dtype
    names = sorted({_dtype_name(spec.dtype) for stage in worker_specs for spec in stage.values()})
    return "/".join(names)


@contextlib.contextmanager
def _quiet_vllm(verbose: bool) -> Iterator[None]:
    """Silence vLLM's logging while planning: vLLM logs to stdout, which
    would break ``--json``, and its start-up chatter is not the answer.
    ``--verbose`` keeps it."""
    if verbose:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        yield
    finally:
        logging.disable(previous)


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _check_model_source(model: str) -> None:
    """A local folder with a config.json, or a model id in the local Hugging
    Face cache; say which of the two is missing otherwise."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "params.json").is_file():
            raise PlanError(f"model folder {model!r} has no config.json; pass a Hugging Face model folder")
        return
    if path.exists():
        raise PlanError(f"model {model!r} is a file, not a model folder; pass the folder that holds config.json")
    looks_local = Path(model.split("/")[0]).expanduser().is_dir() and "/" in model
    if looks_local or not _REPO_ID.match(model) or model.startswith((".", "~")) or model.count("/") > 1:
        raise PlanError(f"model folder {model!r} does not exist")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(model, "config.json"), str):
        raise PlanError(
            f"model {model!r} is neither a local folder nor in the local Hugging Face cache "
            f"(the planner works offline); download it first, e.g. `hf download {model} "
            f"config.json`, or pass a local model folder"
        )


def _first_line(exc: BaseException) -> str:
    """The gist of an exception on one line (pydantic's validation errors
    put it on their second line)."""
    text = str(exc).strip() or type(exc).__name__
    errors = getattr(exc, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            text = str(errors()[0]["msg"]).strip().removeprefix("Value error, ")
    line = text.splitlines()[0] if text else type(exc).__name__
    # vLLM follows an unknown architecture with the list of all it knows.
    line = line.split(" Supported architectures:")[0]
    return line if len(line) <= 400 else line[:397] + "..."


def _engine_config(args: argparse.Namespace) -> Any:
    """vLLM's own VllmConfig for the arguments, as ``vllm serve`` builds it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    kwargs: dict[str, Any] = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "trust_remote_code": args.trust_remote_code,
    }
    # A cap in the environment is for engines; the planner answers for the
    # cap given on its own command line.
    saved_cap = os.environ.pop(ENV_VAR, None)
    try:
        return EngineArgs(**kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # vLLM's validation: one line, no traceback
        raise PlanError(f"vLLM rejects {args.model!r} with these options: {_first_line(exc)}") from exc
    finally:
        if saved_cap is not None:
            os.environ[ENV_VAR] = saved_cap


def _planning_function(name: str) -> Callable[..., Any]:
    """vLLM's KV cache planning moved to ``kv_cache_planning`` in 0.33."""
    for module_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise PlanError(f"this vLLM has no {name}; {PROG} supports vLLM 0.32 and 0.33")


def _kv_cache_configs(vllm_config: Any, worker_specs: list[dict[str, Any]], nbytes: int) -> list[Any]:
    """vLLM's ``get_kv_cache_configs`` for every worker given ``nbytes``."""
    get_kv_cache_configs = _planning_function("get_kv_cache_configs")
    specs = [dict(spec) for spec in worker_specs]
    memory = [nbytes] * len(specs)
    if "global_kv_cache_groups" in inspect.signature(get_kv_cache_configs).parameters:
        groups = _planning_function("get_global_kv_cache_groups")(vllm_config, specs)
        return get_kv_cache_configs(vllm_config, specs, memory, groups)
    return get_kv_cache_configs(vllm_config, specs, memory)


def _fits_one_request(vllm_config: Any, worker_specs: list[dict[str, Any]], nbytes: int) -> bool:
    """vLLM's own start-up check: does ``nbytes`` hold one request of
    max_model_len besides the null block?"""
    try:
        _kv_cache_configs(vllm_config, worker_specs, nbytes)
    except ValueError:
        return False
    return True


def _blocks_per_request(vllm_config: Any, worker_specs: list[dict[str, Any]], block_bytes: int) -> int:
    """Blocks one request of max_model_len holds, read off vLLM's own
    start-up check: the smallest block count it accepts, less the null block."""
    low, high = NULL_BLOCKS, NULL_BLOCKS + 1  # low fails, high is probed
    while not _fits_one_request(vllm_config, worker_specs, high * block_bytes):
        low, high = high, high * 2
        if high > _PROBE_BYTES // block_bytes:
            raise PlanError(
                f"vLLM accepts no KV cache size up to {format_size(_PROBE_BYTES)} for one request "
                f"of {vllm_config.model_config.max_model_len} tokens"
            )
    while high - low > 1:
        mid = (low + high) // 2
        if _fits_one_request(vllm_config, worker_specs, mid * block_bytes):
            high = mid
        else:
            low = mid
    return high - NULL_BLOCKS


def _resolve_layout(vllm_config: Any, specs: list[Any]) -> None:
    """Resolve the KV cache layout as the engine core does, from the
    attention backends the layers chose."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    backends = get_current_attn_backends(vllm_config)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vllm_config, [layouts], specs)


def _attention_specs(vllm_config: Any, recipe: _Recipe) -> list[dict[str, Any]]:
    """Per-worker KV cache specs: vLLM ``Attention`` layers built with the
    model's per-device heads, head size and sliding windows, asked for their
    spec as the model runner asks them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_kv_cache_limit.compat import customize_attention_spec

    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    hf_config = model_config.hf_text_config
    head_size = recipe.head_size(model_config)
    total_layers = model_config.get_total_num_hidden_layers()
    pp_size = parallel_config.pipeline_parallel_size
    tp_size = parallel_config.tensor_parallel_size

    stages: list[dict[str, Any]] = []
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype):
        for pp_rank in range(pp_size):
            start, end = get_pp_indices(total_layers, pp_rank, pp_size)
            stage: dict[str, Any] = {}
            for layer in range(start, end):
                arch = model_config.model_arch_config[layer]
                attention = Attention(
                    model_config.get_num_attention_heads(parallel_config, arch),
                    head_size,
                    head_size**-0.5,
                    num_kv_heads=model_config.get_num_kv_heads(parallel_config, arch),
                    cache_config=vllm_config.cache_config,
                    quant_config=vllm_config.quant_config,
                    per_layer_sliding_window=recipe.window(hf_config, layer),
                    prefix=f"model.layers.{layer}.self_attn.attn",
                )
                spec = attention.get_kv_cache_spec(vllm_config)
                if spec is not None:
                    stage[attention.layer_name] = customize_attention_spec(attention.get_attn_backend(), spec)
            stages.append(stage)
    _resolve_layout(vllm_config, [s for stage in stages for s in stage.values()])
    # Workers in DP x PP x TP order; the TP ranks of a stage hold the same specs.
    return [stage for stage in stages for _ in range(tp_size)]


def _mla_specs(vllm_config: Any) -> list[dict[str, Any]]:
    """MLA layers: one latent KV head per layer, not split by tensor
    parallelism. An estimate: the MLA backends' own padding is not applied."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config)
    total_layers = model_config.get_total_num_hidden_layers()
    stages = []
    for pp_rank in range(parallel_config.pipeline_parallel_size):
        start, end = get_pp_indices(total_layers, pp_rank, parallel_config.pipeline_parallel_size)
        stages.append(
            {
                f"model.layers.{layer}.self_attn.attn": MLAAttentionSpec(
                    block_size=cache_config.block_size,
                    num_kv_heads=1,
                    head_size=model_config.get_head_size(),
                    dtype=dtype,
                    cache_dtype_str=cache_config.cache_dtype,
                )
                for layer in range(start, end)
            }
        )
    # No layers are registered: vLLM falls back to the platform's MLA backend.
    _resolve_layout(vllm_config, [s for stage in stages for s in stage.values()])
    return [stage for stage in stages for _ in range(parallel_config.tensor_parallel_size)]


def _layer_kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    if type(spec).__name__.startswith("MLA"):
        return "MLA"
    return "sliding window" if isinstance(spec, SlidingWindowSpec) else "full attention"


def _describe_layers(configs: list[Any], tp_size: int) -> list[dict[str, Any]]:
    """The model's layers as vLLM planned them (block sizes after its page
    unification), one row per distinct spec, per device."""
    rows: dict[tuple, dict[str, Any]] = {}
    seen: set[str] = set()
    for config in configs[::tp_size]:  # one worker per pipeline stage
        for group in config.kv_cache_groups:
            for name in group.layer_names:
                if name in seen:
                    continue
                seen.add(name)
                spec = group.kv_cache_spec
                spec = getattr(spec, "kv_cache_specs", {}).get(name, spec)
                kind = _layer_kind(spec)
                window = spec.sliding_window if kind == "sliding window" else None
                key = (kind, window, spec.num_kv_heads, spec.head_size, spec.block_size, spec.page_size_bytes)
                row = rows.setdefault(
                    key,
                    {
                        "kind": kind,
                        "sliding_window": window,
                        "num_layers": 0,
                        "num_kv_heads": spec.num_kv_heads,
                        "head_size": spec.head_size,
                        "block_size": spec.block_size,
                        "page_bytes": spec.page_size_bytes,
                        "dtype": _dtype_name(spec.dtype),
                    },
                )
                row["num_layers"] += 1
    return list(rows.values())


def _engine_block_size(groups: list[Any]) -> int:
    """``cache_config.block_size`` as the engine core sets it after planning:
    the smallest block of the groups that take part in prefix caching."""
    participating = [g.kv_cache_spec.block_size for g in groups if getattr(g.kv_cache_spec, "prefix_cacheable", True)]
    return min(participating or [g.kv_cache_spec.block_size for g in groups])


def load_model_kv_cache(args: argparse.Namespace) -> ModelKVCache:
    """Build the model's VllmConfig and KV cache specs, then read bytes per
    block and blocks per request off vLLM's own planning."""
    vllm_config = _engine_config(args)
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    architecture = model_config.architecture
    estimate_reason: str | None = None

    if model_config.is_attention_free:
        raise PlanError(f"{architecture} is attention-free: vLLM allocates no KV cache for it")
    if model_config.is_hybrid:
        raise PlanError(
            f"{architecture} mixes attention with Mamba or linear-attention layers, whose state "
            f"{PROG} does not model; it covers attention-only models"
        )
    try:
        if model_config.use_mla:
            worker_specs = _mla_specs(vllm_config)
            estimate_reason = (
                f"{architecture} uses MLA; planned as one latent KV head of "
                f"{model_config.get_head_size()} per layer without the MLA backends' padding"
            )
        else:
            recipe = EXACT_ARCHITECTURES.get(architecture)
            if recipe is None:
                estimate_reason = (
                    f"{PROG} mirrors the attention layers of {', '.join(sorted(EXACT_ARCHITECTURES))} "
                    f"only; {architecture} is planned as plain attention layers with sliding "
                    f"windows from layer_types"
                )
                recipe = _Recipe()
            worker_specs = _attention_specs(vllm_config, recipe)
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"cannot build the KV cache layers of {architecture}: {_first_line(exc)}") from exc
    if not any(worker_specs):
        raise PlanError(f"{architecture} has no KV cache layers")

    register_all_kvcache_specs(vllm_config)
    try:
        configs = _kv_cache_configs(vllm_config, worker_specs, _PROBE_BYTES)
    except Exception as exc:
        raise PlanError(f"vLLM cannot plan a KV cache for {architecture}: {_first_line(exc)}") from exc
    # Every worker gets the same number of blocks; the one with the largest
    # block (the largest pipeline stage) is the one a cap binds.
    block_bytes = max(max(t.size for t in c.kv_cache_tensors) // c.num_blocks for c in configs)
    block_size = _engine_block_size(configs[0].kv_cache_groups)
    per_request = _blocks_per_request(vllm_config, worker_specs, block_bytes)

    def blocks_for(nbytes: int) -> int:
        try:
            configs = _kv_cache_configs(vllm_config, worker_specs, nbytes)
        except ValueError:  # vLLM refuses to start: not one request's worth
            return 0
        return min(config.num_blocks for config in configs)

    return ModelKVCache(
        model=args.model,
        architecture=architecture,
        exact=estimate_reason is None,
        estimate_reason=estimate_reason,
        vllm_version=vllm.__version__,
        platform=current_platform.device_type,
        max_model_len=model_config.max_model_len,
        tensor_parallel_size=parallel_config.tensor_parallel_size,
        pipeline_parallel_size=parallel_config.pipeline_parallel_size,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        dtype=_dtype_name(model_config.dtype),
        kv_cache_dtype=_kv_cache_dtype_name(cache_config.cache_dtype, worker_specs),
        block_size=block_size,
        bytes_per_block=block_bytes,
        blocks_per_request=per_request,
        num_groups=len(configs[0].kv_cache_groups),
        layers=_describe_layers(configs, parallel_config.tensor_parallel_size),
        blocks_for=blocks_for,
    )


# ---------------------------------------------------------------------------
# The plan and its two outputs
# ---------------------------------------------------------------------------


@dataclass
class KVCachePlan:
    """Everything the planner reports; ``as_json`` gives the --json object."""

    kv: ModelKVCache
    concurrency: int
    required_blocks: int
    required_bytes: int
    suggested: str
    suggested_bytes: int
    suggested_num_blocks: int
    cap: str | None = None
    cap_bytes: int | None = None
    num_blocks: int | None = None

    def as_json(self) -> dict[str, Any]:
        kv = self.kv
        out: dict[str, Any] = {
            "model": kv.model,
            "architecture": kv.architecture,
            "exact": kv.exact,
            "estimate": kv.estimate_reason,
            "vllm_version": kv.vllm_version,
            "platform": kv.platform,
            "max_model_len": kv.max_model_len,
            "concurrency": self.concurrency,
            "tensor_parallel_size": kv.tensor_parallel_size,
            "pipeline_parallel_size": kv.pipeline_parallel_size,
            "max_num_batched_tokens": kv.max_num_batched_tokens,
            "dtype": kv.dtype,
            "kv_cache_dtype": kv.kv_cache_dtype,
            "layers": kv.layers,
            "kv_cache_groups": kv.num_groups,
            "block_size": kv.block_size,
            "bytes_per_token": bytes_per_token(kv.bytes_per_block, kv.block_size),
            "bytes_per_block": kv.bytes_per_block,
            "blocks_per_request": kv.blocks_per_request,
            "null_blocks": NULL_BLOCKS,
            "required_blocks": self.required_blocks,
            "required_bytes": self.required_bytes,
            "suggested_kv_cache_max_memory": self.suggested,
            "suggested_bytes": self.suggested_bytes,
            "suggested_num_blocks": self.suggested_num_blocks,
            "flag": f"{FLAG} {self.suggested}",
        }
        if self.num_blocks is not None:
            usable, tokens, max_concurrency = capacity(self.num_blocks, kv.blocks_per_request, kv.max_model_len)
            out.update(
                kv_cache_max_memory=self.cap,
                kv_cache_max_memory_bytes=self.cap_bytes,
                num_blocks=self.num_blocks,
                usable_blocks=usable,
                tokens=tokens,
                max_concurrency=max_concurrency,
            )
        return out


def make_plan(kv: ModelKVCache, concurrency: int, cap: str | None = None) -> KVCachePlan:
    """Forward answer for ``concurrency`` requests, and the reverse answer
    for ``cap`` when given."""
    needed = required_blocks(kv.blocks_per_request, concurrency)
    suggested, suggested_bytes, suggested_blocks = suggest_cap(needed * kv.bytes_per_block, needed, kv.blocks_for)
    plan = KVCachePlan(
        kv=kv,
        concurrency=concurrency,
        required_blocks=needed,
        required_bytes=needed * kv.bytes_per_block,
        suggested=suggested,
        suggested_bytes=suggested_bytes,
        suggested_num_blocks=suggested_blocks,
    )
    if cap is not None:
        cap_bytes = parse_size(cap)
        minimum = required_blocks(kv.blocks_per_request, 1) * kv.bytes_per_block
        if cap_bytes < minimum:
            raise PlanError(
                f"{FLAG} {cap} ({cap_bytes} bytes) is too small: vLLM refuses to start unless the KV "
                f"cache holds one request of {kv.max_model_len} tokens ({kv.blocks_per_request} blocks) "
                f"plus the null block, {minimum} bytes per device; pass at least "
                f"{FLAG} {format_size(minimum, 'up')} or a smaller --max-model-len"
            )
        plan.cap, plan.cap_bytes, plan.num_blocks = cap, cap_bytes, kv.blocks_for(cap_bytes)
    return plan


def _size(nbytes: int) -> str:
    return f"{nbytes} B ({format_size(nbytes, 'up')})" if nbytes >= 1024 else f"{nbytes} B"


def format_human(plan: KVCachePlan) -> str:
    """The short table printed by default."""
    kv = plan.kv
    data = plan.as_json()
    label = "exact" if kv.exact else "ESTIMATE"
    lines = [
        f"{kv.model} ({kv.architecture}), vLLM {kv.vllm_version} on {kv.platform}: {label}",
    ]
    if not kv.exact:
        lines.append(f"ESTIMATE: {kv.estimate_reason}")
    lines.append(
        f"per device: tensor parallel {kv.tensor_parallel_size}, pipeline parallel "
        f"{kv.pipeline_parallel_size}, dtype {kv.dtype}, KV cache dtype {kv.kv_cache_dtype}"
    )
    for layer in kv.layers:
        window = f" (window {layer['sliding_window']})" if layer["sliding_window"] else ""
        lines.append(
            f"layers: {layer['num_layers']} {layer['kind']}{window}, {layer['num_kv_heads']} KV "
            f"heads x {layer['head_size']} per device, {layer['dtype']}, "
            f"{layer['block_size']}-token blocks"
        )
    rows = [
        ("block size", f"{kv.block_size} tokens"),
        ("KV cache per token", f"{data['bytes_per_token']} B"),
        ("KV cache per block", _size(kv.bytes_per_block)),
        (
            "blocks per request",
            f"{kv.blocks_per_request} (max-model-len {kv.max_model_len}"
            + (f", over {kv.num_groups} KV cache groups)" if kv.num_groups > 1 else ")"),
        ),
        ("memory per request", _size(kv.blocks_per_request * kv.bytes_per_block)),
        (
            "blocks needed",
            f"{plan.required_blocks} = {plan.concurrency} x {kv.blocks_per_request} + {NULL_BLOCKS} null block",
        ),
        ("memory needed", f"{_size(plan.required_bytes)} per device"),
        ("suggested", f"{FLAG} {plan.suggested}  ({plan.suggested_num_blocks} blocks)"),
    ]
    if plan.num_blocks is not None:
        rows += [
            (f"with {FLAG} {plan.cap}", f"{_size(plan.cap_bytes or 0)} per device"),
            ("  blocks", f"{data['num_blocks']} ({data['usable_blocks']} usable + {NULL_BLOCKS} null)"),
            ("  tokens", f"{data['tokens']}"),
            (
                "  max concurrency",
                f"{data['max_concurrency']} request{'' if data['max_concurrency'] == 1 else 's'} "
                f"of {kv.max_model_len} tokens",
            ),
        ]
    width = max(len(name) for name, _ in rows)
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = _human_int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be a whole number such as 8, 4096 or 32k, got {value!r}"
            ) from None
        if number < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value!r}")
        return number

    parse.__name__ = name
    return parse


_HUMAN_INT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*$")


def _human_int(value: str) -> int:
    """Integers as vLLM's CLI reads them: 32k = 32000, 32K = 32768."""
    match = _HUMAN_INT.match(value)
    if match is None:
        raise ValueError(value)
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    if "." in number and (suffix == "" or suffix.isupper()):
        raise ValueError(value)
    if "." in number:
        return int(float(number) * scale)
    return int(number) * scale


def _size_arg(value: str) -> str:
    try:
        parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line, with vLLM's option names and defaults."""
    parser = _Parser(
        prog=PROG,
        description=(
            "How much KV cache memory a vLLM model needs per device, computed with vLLM's own "
            "KV cache planning, and the --kv-cache-max-memory to pass. Offline: MODEL is a "
            "local folder or a model id already in the Hugging Face cache; no weights are loaded."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="model folder, or model id in the local Hugging Face cache")
    parser.add_argument(
        "--max-model-len",
        type=_positive_int("--max-model-len"),
        default=None,
        help="tokens per request (prompt + output); default: the model's own, as vLLM derives it",
    )
    parser.add_argument(
        "--concurrency",
        type=_positive_int("--concurrency"),
        default=1,
        help="requests of max-model-len tokens that must fit at once (default: 1)",
    )
    parser.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=_positive_int("--tensor-parallel-size"),
        default=1,
        help="tensor parallel size (default: 1); all sizes are per device",
    )
    parser.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=_positive_int("--pipeline-parallel-size"),
        default=1,
        help="pipeline parallel size (default: 1)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache data type, as vLLM's --kv-cache-dtype (default: auto, the model's dtype on this platform)",
    )
    parser.add_argument(
        "--block-size",
        type=_positive_int("--block-size"),
        default=None,
        help="tokens per KV cache block; default: the platform's (128 on the CPU backend)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model data type, as vLLM's --dtype (default: auto)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int("--max-num-batched-tokens"),
        default=None,
        help="scheduler budget per step; sliding-window layers keep this many extra tokens "
        "(default: vLLM's default for `vllm serve`; LLM(...) uses a larger one)",
    )
    parser.add_argument(
        FLAG,
        dest="kv_cache_max_memory",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="also answer the reverse question: the blocks, tokens and concurrency this cap gives",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="as vLLM's --trust-remote-code")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("-v", "--verbose", action="store_true", help="keep vLLM's own log lines")
    return parser


def _check_choices(args: argparse.Namespace) -> None:
    """Reject a KV cache dtype or dtype vLLM does not know, listing its own."""
    import typing

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    for option, value, literal in (
        ("--kv-cache-dtype", args.kv_cache_dtype, CacheDType),
        ("--dtype", args.dtype, ModelDType),
    ):
        choices = typing.get_args(literal)
        if value not in choices:
            raise PlanError(f"{option} {value!r} is not one of vLLM's: {', '.join(choices)}")


def run(args: argparse.Namespace) -> str:
    """Plan and return the text to print."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    _check_model_source(args.model)
    with _quiet_vllm(args.verbose):
        _check_choices(args)
        kv = load_model_kv_cache(args)
        plan = make_plan(kv, args.concurrency, args.kv_cache_max_memory)
    if args.json:
        return json.dumps(plan.as_json(), indent=2)
    return format_human(plan)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``vllm-kv-plan``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        output = run(args)
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.verbose:
            raise
        print(
            f"{PROG}: error: unexpected {type(exc).__name__}: {_first_line(exc)} (--verbose shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    try:
        print(output, flush=True)
    except BrokenPipeError:  # e.g. `vllm-kv-plan ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
