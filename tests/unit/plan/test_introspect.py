"""A model's KV cache read through vLLM's configuration (no engine, no
weights loaded), and the vLLM functions read that way, all in
``compat.PLANNER_APIS``."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.unit.plan.conftest import ATTENTION, BF16, CPU_BLOCK, fails, plan_json
from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.plan import introspect, main


def test_vllm_functions_called_are_the_planner_apis() -> None:
    """Every vLLM function the planner calls is found through
    ``compat.PLANNER_APIS`` (so scripts/check_hooks.py checks it), and every
    entry there is called; the customize pair is reached through
    ``compat.customize_attention_spec``."""
    tree = ast.parse(Path(introspect.__file__).read_text())
    called = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "_vllm_function"
        and isinstance(node.args[0], ast.Constant)
    }
    customize = {"customize_attention_spec", "AttentionBackend.customize_spec"}
    assert called == {h.qualname for h in compat.PLANNER_APIS} - customize
    assert "compat.customize_attention_spec(" in ast.unparse(tree)


def _llama_bytes_per_token(model: str, tp: int = 1, dtype_bytes: int = BF16) -> int:
    config = json.loads(Path(model, "config.json").read_text())
    kv_heads = max(1, config["num_key_value_heads"] // tp)
    return 2 * config["num_hidden_layers"] * kv_heads * config["head_dim"] * dtype_bytes


def test_llama_forward_answer_matches_the_config(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json([tiny_llama, "--max-model-len", "512", "--concurrency", "3"], capsys)
    per_token = _llama_bytes_per_token(tiny_llama)
    assert per_token == 1024
    assert plan["exact"] is True and plan["estimate"] is None
    assert plan["architecture"] == "LlamaForCausalLM"
    assert plan["block_size"] == CPU_BLOCK
    assert plan["kv_cache_dtype"] == "bfloat16"
    assert plan["bytes_per_token"] == per_token
    assert plan["bytes_per_block"] == per_token * CPU_BLOCK
    assert plan["blocks_per_request"] == math.ceil(512 / CPU_BLOCK)
    assert plan["required_blocks"] == 3 * 4 + 1
    assert plan["required_bytes"] == 13 * per_token * CPU_BLOCK
    assert plan["suggested_kv_cache_max_memory"] == format_size(plan["required_bytes"], "up")
    assert plan["suggested_num_blocks"] == parse_size(plan["suggested_kv_cache_max_memory"]) // plan["bytes_per_block"]
    assert plan["flag"] == f"--kv-cache-max-memory {plan['suggested_kv_cache_max_memory']}"
    assert "num_blocks" not in plan
    assert plan["layers"] == [
        {
            "kind": "full attention",
            "sliding_window": None,
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_size": 64,
            "block_size": CPU_BLOCK,
            "page_bytes": 2 * 2 * 64 * BF16 * CPU_BLOCK,
            "dtype": "bfloat16",
        }
    ]


def test_llama_reverse_answer(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The measured engine: 16M gives 128 blocks of 128 KiB.
    plan = plan_json([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", "16M"], capsys)
    assert plan["kv_cache_max_memory"] == "16M"
    assert plan["kv_cache_max_memory_bytes"] == 16 * 2**20
    assert plan["num_blocks"] == 16 * 2**20 // (1024 * CPU_BLOCK) == 128
    assert plan["usable_blocks"] == 127
    assert plan["tokens"] == 127 * CPU_BLOCK
    assert plan["max_concurrency"] == 127 // 4


def test_suggestion_is_the_least_that_holds_the_concurrency(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    forward = plan_json([tiny_llama, "--max-model-len", "256", "--concurrency", "5"], capsys)
    back = plan_json(
        [tiny_llama, "--max-model-len", "256", "--kv-cache-max-memory", forward["suggested_kv_cache_max_memory"]],
        capsys,
    )
    assert back["num_blocks"] == forward["suggested_num_blocks"]
    assert back["max_concurrency"] >= 5
    one_block_less = str(forward["required_bytes"] - 1)
    short = plan_json([tiny_llama, "--max-model-len", "256", "--kv-cache-max-memory", one_block_less], capsys)
    assert short["num_blocks"] == forward["required_blocks"] - 1
    assert short["max_concurrency"] == 4


def test_parallelism_dtype_and_block_size(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    tp2 = plan_json([tiny_llama, "--max-model-len", "512", "-tp", "2"], capsys)
    assert tp2["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, tp=2) == 512
    assert tp2["tensor_parallel_size"] == 2
    # 2 KV heads over 4 ranks: one replicated head each, as vLLM does.
    tp4 = plan_json([tiny_llama, "--max-model-len", "512", "-tp", "4"], capsys)
    assert tp4["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, tp=4) == 512
    pp2 = plan_json([tiny_llama, "--max-model-len", "512", "-pp", "2"], capsys)
    assert pp2["bytes_per_token"] == 1024 // 2  # one of the two layers per stage
    fp32 = plan_json([tiny_llama, "--max-model-len", "512", "--dtype", "float32", "--block-size", "64"], capsys)
    assert fp32["kv_cache_dtype"] == "float32"
    assert fp32["block_size"] == 64
    assert fp32["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, dtype_bytes=4)
    assert fp32["blocks_per_request"] == 512 // 64


def test_too_small_cap_names_the_minimum(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = fails([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", "100K"], capsys)
    minimum = 5 * 1024 * CPU_BLOCK
    assert "is too small" in err and f"{minimum} bytes per device" in err
    assert f"--kv-cache-max-memory {format_size(minimum, 'up')}" in err
    plan = plan_json([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", str(minimum)], capsys)
    assert plan["num_blocks"] == 5 and plan["max_concurrency"] == 1


def test_vllm_rejections_are_one_line(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = fails([tiny_llama, "--max-model-len", "100000"], capsys)
    assert "User-specified max_model_len (100000) is greater than the derived max_model_len" in err
    err = fails([tiny_llama, "-tp", "3"], capsys)
    assert "must be divisible by tensor parallel size (3)" in err
    err = fails([tiny_llama, "--kv-cache-dtype", "int3"], capsys)
    assert "--kv-cache-dtype 'int3' is not one of vLLM's: auto," in err


def test_unknown_architecture(tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads(Path(tiny_llama, "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = fails([str(tmp_path)], capsys)
    assert "Model architectures ['NoSuchForCausalLM'] are not supported" in err
    assert "Supported architectures" not in err
    config["model_type"] = "no_such_model_type"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "model type `no_such_model_type`" in fails([str(tmp_path)], capsys)


def test_gemma2_sliding_window_layers(tiny_gemma2: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads(Path(tiny_gemma2, "config.json").read_text())
    window = config["sliding_window"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    plan = plan_json([tiny_gemma2, "--max-model-len", "1024", "--max-num-batched-tokens", "256"], capsys)
    assert plan["exact"] is True
    kinds = {row["kind"]: row for row in plan["layers"]}
    assert kinds["sliding window"]["sliding_window"] == window
    assert kinds["sliding window"]["num_layers"] == kinds["full attention"]["num_layers"] == 2
    # One block id serves one group (two layers) per block.
    assert plan["bytes_per_block"] == 2 * (2 * 2 * 64 * BF16) * CPU_BLOCK
    full = math.ceil(1024 / CPU_BLOCK)
    # A sliding layer keeps at most window - 1 + in-flight tokens, plus a block.
    assert full < plan["blocks_per_request"] < 2 * full
    longer = plan_json([tiny_gemma2, "--max-model-len", "2048", "--max-num-batched-tokens", "256"], capsys)
    assert longer["blocks_per_request"] - plan["blocks_per_request"] == math.ceil(2048 / CPU_BLOCK) - full


def test_architecture_not_mirrored_is_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any
) -> None:
    model = config_only(
        tmp_path,
        "Phi3Config",
        **ATTENTION,
        max_position_embeddings=2048,
        architectures=["Phi3ForCausalLM"],
    )
    plan = plan_json([model, "--max-model-len", "512"], capsys)
    assert plan["exact"] is False
    assert "Phi3ForCausalLM is planned as plain attention layers" in plan["estimate"]
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 64 * BF16
    main([model, "--max-model-len", "512"])
    out = capsys.readouterr().out
    assert "ESTIMATE: " in out and ": ESTIMATE" in out.splitlines()[0]


def test_mla_is_an_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any) -> None:
    model = config_only(
        tmp_path,
        "DeepseekV3Config",
        **{**ATTENTION, "num_key_value_heads": 4},
        max_position_embeddings=2048,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        moe_intermediate_size=128,
        n_group=1,
        topk_group=1,
        architectures=["DeepseekV3ForCausalLM"],
    )
    plan = plan_json([model, "--max-model-len", "512"], capsys)
    assert plan["exact"] is False and "uses MLA" in plan["estimate"]
    (row,) = plan["layers"]
    assert row["kind"] == "MLA" and row["num_kv_heads"] == 1 and row["head_size"] == 64 + 32
    assert plan["bytes_per_token"] == 2 * (64 + 32) * BF16  # one latent vector per layer


def test_hybrid_and_attention_free_models_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any
) -> None:
    jamba = config_only(
        tmp_path / "jamba",
        "JambaConfig",
        **ATTENTION,
        architectures=["JambaForCausalLM"],
    )
    assert "JambaForCausalLM mixes attention with Mamba" in fails([jamba], capsys)
    mamba = config_only(
        tmp_path / "mamba",
        "MambaConfig",
        architectures=["MambaForCausalLM"],
    )
    assert "MambaForCausalLM is attention-free" in fails([mamba], capsys)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "mixtral"])
def test_other_architectures_are_exact(
    arch: str, tmp_path: Path, cpu_vllm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The full-attention architectures whose engine runs are ``slow``
    (tests/e2e/test_plan_e2e.py, outside CI): the planner reads each through
    vLLM's own code as exact, with the bytes per token of its config and
    whole blocks per request, as for Llama (whose engine run is in CI)."""
    from tests.tiny_model import build_tiny_model

    model = str(build_tiny_model(tmp_path / arch, arch))
    plan = plan_json([model, "--max-model-len", "1024", "--concurrency", "3"], capsys)
    assert plan["exact"] is True and plan["estimate"] is None, plan["estimate"]
    config = json.loads(Path(model, "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BF16
    assert plan["bytes_per_token"] == per_token
    assert plan["bytes_per_block"] == per_token * CPU_BLOCK
    assert plan["blocks_per_request"] == math.ceil(1024 / CPU_BLOCK)
    assert plan["required_blocks"] == 3 * plan["blocks_per_request"] + 1
