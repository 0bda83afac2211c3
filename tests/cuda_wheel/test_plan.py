"""``vllm-kv-plan`` against vLLM's CUDA wheel on a faked GPU: the plan is
vLLM's own for the installed release (on 0.34, 64-token blocks by default on
CUDA), and the cap it suggests is the one vLLM's own ``get_kv_cache_configs``
turns into exactly the blocks the plan promises."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import EngineArgs

from tests.cuda_wheel.conftest import FakeGPU, GiB, attention_specs
from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.plan import main

MAX_MODEL_LEN = 512


def _plan(capsys: pytest.CaptureFixture[str], model: str, *extra: str) -> dict:
    assert main([model, "--max-model-len", str(MAX_MODEL_LEN), "--concurrency", "3", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_is_the_installed_releases(fake_gpu: FakeGPU, tiny_model: str, capsys) -> None:
    plan = _plan(capsys, tiny_model)
    config = EngineArgs(model=tiny_model, max_model_len=MAX_MODEL_LEN).create_engine_config()
    assert plan["platform"] == "cuda" and plan["vllm_version"] == compat.installed_vllm_version()
    # The block size vLLM resolves on CUDA for this release (64 on 0.34, 16 before).
    assert plan["block_size"] == config.cache_config.block_size
    if compat.installed_vllm_version() >= "0.34":
        assert plan["block_size"] == 64
    # Blocks per request follow from it: one request of max_model_len.
    assert plan["blocks_per_request"] == -(-MAX_MODEL_LEN // plan["block_size"])
    assert plan["bytes_per_block"] == plan["bytes_per_token"] * plan["block_size"]


def test_the_suggested_cap_gives_vllm_the_planned_blocks(fake_gpu: FakeGPU, tiny_model: str, capsys) -> None:
    """The suggested size, through vLLM's own ``get_kv_cache_configs`` under
    the plugin's cap, with far more memory available, gives exactly the
    plan's ``suggested_num_blocks``: three requests of ``max_model_len``
    plus the null block."""
    import vllm.v1.engine.core as engine_core

    if not hasattr(engine_core, "get_global_kv_cache_groups"):
        pytest.skip(f"vLLM {compat.installed_vllm_version()} plans KV cache groups inside get_kv_cache_configs")
    plan = _plan(capsys, tiny_model)
    assert plan["suggested_num_blocks"] == plan["required_blocks"] == 3 * plan["blocks_per_request"] + 1
    config = EngineArgs(
        model=tiny_model, max_model_len=MAX_MODEL_LEN, kv_cache_max_memory=plan["suggested_bytes"]
    ).create_engine_config()
    _, specs, groups = attention_specs(config)
    configs = engine_core.get_kv_cache_configs(config, specs, [8 * GiB], groups)
    assert configs[0].num_blocks == plan["suggested_num_blocks"]
