"""Fixtures for the end-to-end tests: real vLLM engines on the CPU with the
tiny model, each started in its own process by ``vllm_kv_cache_limit.probe``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_kv_cache_limit.probe import RESULT_PREFIX
from vllm_kv_cache_limit.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
ENGINE_TIMEOUT_S = 300

# Small CPU budget so engines fit beside each other on a 2-core test machine.
BASE_ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 512,
    "gpu_memory_utilization": 0.25,
    "enforce_eager": True,
    "seed": 0,
}


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The embedded tiny Llama, built once (shared with `make serve`)."""
    return str(build_tiny_model(REPO / "models" / "tiny-llama"))


def engine_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("VLLM_KV_CACHE_MAX_MEMORY", None)
    env.update(extra)
    return env


def run_probe(spec: dict[str, Any], env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run one engine in a fresh process; return its result and its log."""
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kv_cache_limit.probe", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
        env=env or engine_env(),
        cwd=REPO,
    )
    log = proc.stdout + proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    assert lines, f"probe printed no result (exit {proc.returncode}):\n{log[-4000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):]), log


@pytest.fixture(scope="session")
def probe(tiny_model: str):
    """``probe(**llm_kwargs)`` starts the tiny model with BASE_ENGINE_ARGS
    plus the given arguments; ``env=`` adds environment variables."""

    def _probe(env: dict[str, str] | None = None, **kwargs: Any) -> tuple[dict[str, Any], str]:
        spec = {"model": tiny_model, **BASE_ENGINE_ARGS, **kwargs}
        return run_probe(spec, engine_env(**(env or {})))

    return _probe
