"""The planner's two outputs: the ``--json`` object and the short table.

Pure logic: no vLLM import.
"""

from __future__ import annotations

from typing import Any

from vllm_kv_cache_limit.logic.cap_decision import FLAG
from vllm_kv_cache_limit.logic.sizes import format_size
from vllm_kv_cache_limit.plan.arithmetic import NULL_BLOCKS, KVCachePlan, bytes_per_token, capacity


def as_json(plan: KVCachePlan) -> dict[str, Any]:
    """The object ``--json`` prints: the model, its KV cache per device, the
    forward answer and, with a cap, the reverse answer."""
    kv = plan.kv
    out: dict[str, Any] = {
        "model": kv.model,
        "architecture": kv.architecture,
        "exact": kv.exact,
        "estimate": kv.estimate_reason,
        "vllm_version": kv.vllm_version,
        "platform": kv.platform,
        "max_model_len": kv.max_model_len,
        "concurrency": plan.concurrency,
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
        "required_blocks": plan.required_blocks,
        "required_bytes": plan.required_bytes,
        "suggested_kv_cache_max_memory": plan.suggested,
        "suggested_bytes": plan.suggested_bytes,
        "suggested_num_blocks": plan.suggested_num_blocks,
        "flag": f"{FLAG} {plan.suggested}",
    }
    if plan.num_blocks is not None:
        usable, tokens, max_concurrency = capacity(plan.num_blocks, kv.blocks_per_request, kv.max_model_len)
        out.update(
            kv_cache_max_memory=plan.cap,
            kv_cache_max_memory_bytes=plan.cap_bytes,
            num_blocks=plan.num_blocks,
            usable_blocks=usable,
            tokens=tokens,
            max_concurrency=max_concurrency,
        )
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes} B ({format_size(nbytes, 'up')})" if nbytes >= 1024 else f"{nbytes} B"


def format_human(plan: KVCachePlan) -> str:
    """The short table printed by default."""
    kv = plan.kv
    data = as_json(plan)
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
