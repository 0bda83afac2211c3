"""Autoscaling through the Python API on a real CPU engine:
``LLM(model, kv_cache_max_memory=..., kv_cache_autoscale=True)`` with no
extra import starts at its floor and grows for a batch that needs more,
and leaves its shared budget's ledger as it exits; an explicit floor above
one request is where it starts, and a resize below that floor is refused
naming it; tensor parallel 2 on one memory node counts both workers' blocks
in the budget; a floor that cannot hold one request fails at start-up,
quoted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import cap_error
from tests.e2e.test_side_by_side import bind_two_workers

pytestmark = [pytest.mark.plugin_only, pytest.mark.smoke]  # autoscaling is the plugin's; every CPU build

PROMPT = "the quick brown fox jumps over the lazy dog " * 40
"""About 360 tokens: 3 blocks of 128 tokens a request."""


def test_llm_autoscaled_starts_at_its_floor_and_grows_for_a_batch(probe, tmp_path: Path) -> None:
    prompts = [f"{i} {PROMPT}" for i in range(12)]
    locks = tmp_path / "locks"
    result, log = probe(
        env={"VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(locks)},
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_shared_budget="32M",
        prompts=prompts,
        max_tokens=16,
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    # It took its place in the device's ledger, and its clean exit removed
    # its entry (not left to the next instance's reader).
    ledgers = list(locks.glob("budget-*"))
    assert len(ledgers) == 1 and (ledgers[0] / "ledger.lock").is_file(), sorted(locks.rglob("*"))
    assert not list(ledgers[0].glob("*.entry")), sorted(ledgers[0].iterdir())
    assert "shared budget 32MiB of host memory node 0 (CPU backend), others hold 0B (none)" in log, log[-3000:]
    assert result["kv_cache_bytes"] == [16 * 2**20]  # allocated at start-up: the most it can grow to
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    floor, allocated = int(started[1]), int(started[2])
    # max_model_len 512 needs 4 blocks of 128 tokens, plus vLLM's null block.
    assert floor == 5 and allocated == result["num_gpu_blocks"]
    grown = [
        int(m[1]) for m in re.finditer(r"KV cache autoscale: limit \S+ -> \S+ per worker \(\d+ -> (\d+) blocks", log)
    ]
    # 12 requests of 3 blocks do not fit in the floor: the limit grew, and every request finished.
    assert grown and max(grown) > 12 * 3, grown
    assert len(result["texts"]) == len(prompts) and all(result["texts"])


def test_explicit_floor_is_the_start_and_a_resize_below_it_is_refused(probe) -> None:
    # Floor 4M, resize to 2M: above one request (refused by resize itself
    # otherwise), below the floor (refused by the autoscaler, naming it).
    result, log = probe(
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_min_memory="4M",
        prompts=[PROMPT],
        max_tokens=4,
        resize_to="2M",
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    floor, allocated = int(started[1]), int(started[2])
    bytes_per_block = 16 * 2**20 // allocated
    # Premise: 2M lies between one request of max_model_len 512 (4 blocks
    # plus the null block) and the floor, which holds 4M.
    assert 5 * bytes_per_block < 2 * 2**20 < floor * bytes_per_block <= 4 * 2**20, (floor, bytes_per_block)
    assert "resize" not in result, result
    error = result["resize_error"]
    assert error["error_type"] == "KVCacheResizeError", error
    assert "Cannot set the KV cache limit to 2MiB (2097152 bytes) while autoscaling" in error["error"], error
    assert "below the floor, --kv-cache-min-memory" in error["error"], error
    # Refused: the limit is still the floor.
    assert result["status"]["kv_cache_limit_bytes"] == floor * bytes_per_block, result["status"]
    assert len(result["texts"]) == 1 and result["texts"][0]


GROWN = re.compile(
    r"KV cache autoscale: limit \S+ -> \S+ per worker \(\d+ -> (\d+) blocks of \d+ allocated; demand (\d+)"
)


def test_tensor_parallel_workers_on_one_node_share_its_budget(probe, tmp_path: Path) -> None:
    # Both workers keep their KV cache in memory node 0: the budget of 8M
    # for the node holds 4M a worker, though the cap is 16M a worker.
    budget = 8 * 2**20
    result, log = probe(
        env={
            "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(tmp_path / "locks"),
            "VLLM_CPU_OMP_THREADS_BIND": bind_two_workers("tensor-parallel worker"),
        },
        tensor_parallel_size=2,
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_shared_budget="8M",
        prompts=[f"{i} {PROMPT}" for i in range(48)],
        max_tokens=16,
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    assert result["kv_cache_bytes"] == [16 * 2**20] * 2  # each worker allocated the cap
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    bytes_per_block = 16 * 2**20 // int(started[2])  # a worker's
    grown = [(int(m[1]), int(m[2])) for m in GROWN.finditer(log)]
    assert grown, log[-3000:]
    # 48 requests of 3 blocks ask for more than the budget holds for two
    # workers (64 blocks each here): the limit grew to that and no further,
    # though the cap allows 4 times as many blocks.
    most = max(limit for limit, _ in grown)
    assert most == budget // (2 * bytes_per_block), (most, bytes_per_block, grown)
    status = result["status"]
    assert status["autoscale"]["held_bytes"] == 2 * status["kv_cache_limit_bytes"], status
    assert len(result["texts"]) == 48 and all(result["texts"])


def test_floor_that_cannot_hold_one_request_fails_at_startup_quoted(probe) -> None:
    result, log = probe(kv_cache_max_memory="16M", kv_cache_autoscale=True, kv_cache_min_memory="300K")
    message = cap_error(result, log)
    assert "--kv-cache-min-memory 300KiB is refused" in message, message
    assert "one request of max_model_len 512 needs 4 blocks" in message, message
    assert re.search(r"Choose a size of at least \S+ \(\d+ bytes\)", message), message
