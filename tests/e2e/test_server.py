"""The OpenAI-compatible server started with --kv-cache-max-memory."""

from __future__ import annotations

import re

import pytest
import requests

from tests.e2e.conftest import api_servers, engine_env, server_args

MiB = 2**20


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    args = server_args(tiny_model, "16M", 0.25)
    with api_servers({"main": (args, engine_env())}, tmp_path_factory.mktemp("server")) as servers:
        yield servers["main"]


@pytest.mark.smoke
def test_server_answers_a_completion(server) -> None:
    base, _ = server
    reply = requests.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"]


def test_server_answers_a_chat_completion(server) -> None:
    """The tiny model has a chat template (``tests/tiny_model.py``), so chat
    works on it as README's first steps show."""
    base, _ = server
    reply = requests.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


@pytest.mark.smoke
def test_metrics_show_the_cap_and_blocks_within_it(server) -> None:
    base, log_path = server
    metrics = requests.get(f"{base}/metrics", timeout=30).text
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'kv_cache_max_memory="16777216"' in info
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', info)[1])
    line = re.search(r"KV cache max memory: 16MiB = 16777216 bytes .*; (\d+) blocks", log_path.read_text())
    assert line and int(line[1]) == blocks
    block_size = int(re.search(r'block_size="(\d+)"', info)[1])
    # 2 layers x (K, V) x 2 KV heads x head_dim 64 x 2 bytes (bf16) per token.
    assert blocks * block_size * 2 * 2 * 2 * 64 * 2 <= 16 * MiB


@pytest.mark.plugin_only  # run-time resize
def test_resize_routes_absent_without_the_flag(server) -> None:
    """Endpoints that change an engine are off by default: without
    --enable-kv-cache-resize a capped server has no resize route."""
    base, _ = server
    assert requests.get(f"{base}/kv_cache/max_memory", timeout=60).status_code == 404
    assert requests.post(f"{base}/kv_cache/max_memory", json={"size": "8M"}, timeout=60).status_code == 404
    # The server is up and capped: the 404s are not those of a server that is not.
    assert requests.get(f"{base}/health", timeout=60).status_code == 200


@pytest.mark.smoke
def test_api_server_help_lists_the_flag_under_cache_config() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--help=CacheConfig"],
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--kv-cache-max-memory SIZE" in out.stdout, out.stdout[-3000:]
    assert "Upper bound on the memory of the KV cache" in " ".join(out.stdout.split())
