"""``vllm-kv-plan`` against the real engine: for each tiny architecture, a
vLLM CPU engine started with ``kv_cache_max_memory`` set to the planner's
suggestion allocates exactly the planner's blocks, at the planner's bytes per
token. One engine per architecture; in CI one full-attention model (Llama)
and one with sliding-window layers (Gemma 2); the other architectures run
with ``make test-slow`` (``slow``), their planner answers checked in CI by
``tests/unit/plan/test_introspect.py::test_other_architectures_are_exact``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_model import ARCHITECTURES, build_tiny_model
from vllm_kv_cache_limit import plan as kv_plan
from vllm_kv_cache_limit.logic.sizes import parse_size

pytestmark = pytest.mark.plugin_only  # the planner

# Long enough for Gemma 2's 128-token sliding window to hold fewer blocks than
# its full-attention layers: with 256 batched tokens a sliding layer keeps
# cdiv(127 + 256 * batches, 128) + 1 blocks per request, a full one 8.
MAX_MODEL_LEN = 1024
MAX_NUM_BATCHED_TOKENS = 256
CONCURRENCY = 3

CPU_ENGINE_CANNOT_RUN: dict[str, str] = {}
"""Architectures of tiny_model.ARCHITECTURES that vLLM's CPU build cannot
run, with the reason; each is skipped with that reason."""


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def _plan(model: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    status = kv_plan.main(
        [
            model,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            str(MAX_NUM_BATCHED_TOKENS),
            "--concurrency",
            str(CONCURRENCY),
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


IN_CI = ("llama", "gemma2")
"""One full-attention and one sliding-window architecture; the others are
``slow`` (outside CI)."""


def _marks(arch: str) -> list[pytest.MarkDecorator]:
    if arch == "llama":
        return [pytest.mark.smoke]
    return [] if arch in IN_CI else [pytest.mark.slow]


@pytest.mark.parametrize("arch", [pytest.param(a, marks=_marks(a)) for a in sorted(ARCHITECTURES)])
def test_engine_allocates_the_planned_blocks(
    arch: str, tiny_models_dir: Path, capsys: pytest.CaptureFixture[str], probe
) -> None:
    if arch in CPU_ENGINE_CANNOT_RUN:
        pytest.skip(CPU_ENGINE_CANNOT_RUN[arch])
    model = str(build_tiny_model(tiny_models_dir / arch, arch))
    plan = _plan(model, capsys)

    assert plan["exact"] is True, plan["estimate"]
    assert plan["required_blocks"] == CONCURRENCY * plan["blocks_per_request"] + 1
    assert plan["suggested_num_blocks"] >= plan["required_blocks"]
    cap = plan["suggested_kv_cache_max_memory"]
    assert parse_size(cap) >= plan["required_bytes"]

    result, log = probe(
        model=model,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        kv_cache_max_memory=cap,
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"

    assert result["num_gpu_blocks"] == plan["suggested_num_blocks"]
    assert result["block_size"] == plan["block_size"]
    (kv_bytes,) = result["kv_cache_bytes"]  # one worker
    assert kv_bytes == plan["suggested_num_blocks"] * plan["bytes_per_block"]
    assert kv_bytes / (result["num_gpu_blocks"] * result["block_size"]) == plan["bytes_per_token"]
    assert kv_bytes <= parse_size(cap)
