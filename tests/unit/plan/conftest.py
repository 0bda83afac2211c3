"""Shared by the planner's tests: the tiny models (built once per session
under a tmp folder; models that only need a config.json get nothing more)
and the two ways a run ends, a JSON answer or one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_model import build_tiny_model
from vllm_kv_cache_limit.plan import main

CPU_BLOCK = 128  # the CPU backend's block size
BF16 = 2  # bytes; the CPU backend's KV cache dtype for a float32 model


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``vllm-kv-plan argv``; it must fail in one line with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        status = main(argv)
        raise SystemExit(status)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("vllm-kv-plan: error: "), err
    assert "Traceback" not in err
    return err


def plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Run ``vllm-kv-plan argv --json``; it must succeed. Its object."""
    capsys.readouterr()
    status = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


@pytest.fixture(scope="session")
def cpu_vllm() -> None:
    """The expected numbers are those of vLLM's CPU backend."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("expected values are those of vLLM's CPU backend (128-token blocks, bfloat16 KV cache)")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, cpu_vllm: None) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("plan") / "tiny-llama", "llama"))


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory, cpu_vllm: None) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("plan") / "tiny-gemma2", "gemma2"))


@pytest.fixture
def config_only(cpu_vllm: None) -> Any:
    return _config_only


TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 1,
}
"""What every config-only model shares (``config_only`` fills it in)."""
ATTENTION: dict[str, Any] = {"intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
"""The attention of a config-only decoder: 4 heads of 64, 2 KV heads."""


def _config_only(tmp_path: Path, config_class: str, **params: Any) -> str:
    """A model folder holding only a config.json (``TINY_CONFIG`` and
    ``params``): all the planner reads."""
    import transformers

    getattr(transformers, config_class)(**{**TINY_CONFIG, **params}).save_pretrained(tmp_path)
    return str(tmp_path)
