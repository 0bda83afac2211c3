"""A model's KV cache as vLLM plans it: the planner's only vLLM glue.

The configuration is read with vLLM's own ``EngineArgs.create_engine_config``,
so the platform's defaults apply (on the CPU backend: 128-token blocks, a
bfloat16 KV cache for a float32 model). The per-layer KV cache specs come from
vLLM's own attention layers, built as the model's vLLM implementation builds
them (heads per device, head size, sliding window per layer), and vLLM's own
planning (``get_kv_cache_configs``) turns memory into blocks, null block
included. Every vLLM function called here is listed in
``compat.PLANNER_APIS`` and found through it (``_vllm_function``), so
``scripts/check_hooks.py`` checks them against each vLLM build.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.logic.cap_decision import ENV_VAR
from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.plan.arithmetic import NULL_BLOCKS, PROBE_BYTES, ModelKVCache
from vllm_kv_cache_limit.plan.errors import PROG, PlanError, first_line
from vllm_kv_cache_limit.plan.recipes import EXACT_ARCHITECTURES, _dtype_name, _kv_cache_dtype_name, _Recipe


def _vllm_function(qualname: str) -> Callable[..., Any]:
    """The vLLM function ``qualname`` of ``compat.PLANNER_APIS``, from the
    modules listed there and with the parameters listed there."""
    return _resolve(compat.get_hook(qualname, compat.PLANNER_APIS))


def _resolve(hook: compat.Hook) -> Callable[..., Any]:
    function, problem = compat.resolve_hook(hook)
    if function is None:
        raise PlanError(f"{problem}; {PROG} supports vLLM {compat.SUPPORTED_VLLM[1]}")
    return function  # type: ignore[return-value]


@contextlib.contextmanager
def quiet_vllm(verbose: bool) -> Iterator[None]:
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


def check_model_source(model: str) -> None:
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


def check_choices(args: argparse.Namespace) -> None:
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


def _engine_config(args: argparse.Namespace) -> Any:
    """vLLM's own VllmConfig for the arguments, as ``vllm serve`` builds it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    create_engine_config = _vllm_function("EngineArgs.create_engine_config")
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
        return create_engine_config(EngineArgs(**kwargs), UsageContext.OPENAI_API_SERVER)
    except Exception as exc:  # vLLM's validation: one line, no traceback
        raise PlanError(f"vLLM rejects {args.model!r} with these options: {first_line(exc)}") from exc
    finally:
        if saved_cap is not None:
            os.environ[ENV_VAR] = saved_cap


# ---------------------------------------------------------------------------
# vLLM's KV cache planning
# ---------------------------------------------------------------------------


def _kv_cache_configs(vllm_config: Any, worker_specs: list[dict[str, Any]], nbytes: int) -> list[Any]:
    """vLLM's ``get_kv_cache_configs`` for every worker given ``nbytes``."""
    get_kv_cache_configs = _vllm_function("get_kv_cache_configs")
    specs = [dict(spec) for spec in worker_specs]
    memory = [nbytes] * len(specs)
    if "global_kv_cache_groups" in inspect.signature(get_kv_cache_configs).parameters:
        # vLLM 0.33 groups the whole model's layers first, in the same module.
        hook = compat.get_hook("get_kv_cache_configs", compat.PLANNER_APIS)
        get_groups = _resolve(dataclasses.replace(hook, qualname="get_global_kv_cache_groups", params=()))
        return get_kv_cache_configs(vllm_config, specs, memory, get_groups(vllm_config, specs))
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
        if high > PROBE_BYTES // block_bytes:
            raise PlanError(
                f"vLLM accepts no KV cache size up to {format_size(PROBE_BYTES)} for one request "
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
    backends = _vllm_function("get_current_attn_backends")(vllm_config)
    layouts = [layout.name for layout in _vllm_function("get_supported_kv_cache_layouts")(backends)]
    _vllm_function("resolve_kv_cache_layout")(vllm_config, [layouts], specs)


def _attention_specs(vllm_config: Any, recipe: _Recipe) -> list[dict[str, Any]]:
    """Per-worker KV cache specs: vLLM ``Attention`` layers built with the
    model's per-device heads, head size and sliding windows, asked for their
    spec as the model runner asks them."""
    from vllm.model_executor.layers.attention.attention import Attention

    set_current_vllm_config = _vllm_function("set_current_vllm_config")
    set_default_torch_dtype = _vllm_function("set_default_torch_dtype")
    get_pp_indices = _vllm_function("get_pp_indices")
    get_kv_cache_spec = _vllm_function("Attention.get_kv_cache_spec")
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
                spec = get_kv_cache_spec(attention, vllm_config)
                if spec is not None:
                    stage[attention.layer_name] = compat.customize_attention_spec(attention.get_attn_backend(), spec)
            stages.append(stage)
    _resolve_layout(vllm_config, [s for stage in stages for s in stage.values()])
    # Workers in DP x PP x TP order; the TP ranks of a stage hold the same specs.
    return [stage for stage in stages for _ in range(tp_size)]


def _mla_specs(vllm_config: Any) -> list[dict[str, Any]]:
    """MLA layers: one latent KV head per layer, not split by tensor
    parallelism. An estimate: the MLA backends' own padding is not applied."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    parallel_config = vllm_config.parallel_config
    dtype = _vllm_function("kv_cache_dtype_str_to_dtype")(cache_config.cache_dtype, model_config)
    total_layers = model_config.get_total_num_hidden_layers()
    get_pp_indices = _vllm_function("get_pp_indices")
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
        raise PlanError(f"cannot build the KV cache layers of {architecture}: {first_line(exc)}") from exc
    if not any(worker_specs):
        raise PlanError(f"{architecture} has no KV cache layers")

    _vllm_function("register_all_kvcache_specs")(vllm_config)
    try:
        configs = _kv_cache_configs(vllm_config, worker_specs, PROBE_BYTES)
    except Exception as exc:
        raise PlanError(f"vLLM cannot plan a KV cache for {architecture}: {first_line(exc)}") from exc
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
