"""Autoscaling under a shared budget with data parallelism, on a real CPU
server: ``--data-parallel-size 2`` runs two engine cores, each with its
own worker and autoscaler, both keeping their KV cache on the one memory
node. Each takes its own place in the device's ledger, so the budget holds
for the server's engines together, and memory moves between them: load
sent to rank 0 alone (vLLM's ``X-data-parallel-rank`` header) grows it past
half the budget while rank 1 keeps its floor, then load on rank 1 alone
takes it back. At every sample the ledger, read under its lock, holds at
most the budget; no request fails; idle, both fall to their floor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.e2e.conftest import api_servers, engine_env, server_args
from tests.e2e.test_autoscale import wait_for
from tests.helpers import CompletionLoad, Periodic, live_ledger_entries, locked_ledger_holds

pytestmark = [pytest.mark.plugin_only]  # autoscaling is the plugin's

MiB = 2**20
BUDGET = 24 * MiB
"""The cap of each engine core and the budget of both: either could take
all of it, both together may not."""
SHRINK_AFTER_S = 5
CLIENTS = 12
PROMPT = "the quick brown fox jumps over the lazy dog " * 150
"""About 1350 tokens: with 100 generated, 12 blocks of 128 tokens (256 KiB
each in float32) a request, so 12 clients on one rank ask for about 36 MiB,
more than the budget."""
MAX_TOKENS = 100
ROUTE = "/kv_cache/max_memory"


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("autoscale-dp")
    locks = folder / "locks"
    args = server_args(
        tiny_model,
        f"{BUDGET // MiB}M",
        None,
        "--data-parallel-size",
        "2",
        # float32: vLLM 0.32's bfloat16 path can kill a data-parallel
        # engine's worker with SIGILL on AMX hosts (see test_resize).
        "--dtype",
        "float32",
        "--kv-cache-autoscale",
        "--kv-cache-shared-budget",
        f"{BUDGET // MiB}M",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "64",
    )
    env = engine_env(VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks), VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S=str(SHRINK_AFTER_S))
    with api_servers({"dp": (args, env)}, folder) as running:
        yield {"base": running["dp"][0], "log": running["dp"][1], "locks": locks}


def limits(base: str) -> list[int]:
    """Each engine core's limit, in rank order."""
    reply = requests.get(base + ROUTE, timeout=180)
    assert reply.status_code == 200, reply.text
    return [e["kv_cache_limit_bytes"] for e in reply.json()["engines"]]


def on_rank(base: str, rank: int) -> CompletionLoad:
    return CompletionLoad(base, CLIENTS, PROMPT, MAX_TOKENS, headers={"X-data-parallel-rank": str(rank)})


class LedgerSampler(Periodic):
    """The device ledger's holds every half second, read under its lock."""

    def __init__(self, locks: Path) -> None:
        super().__init__(0.5)
        self.locks = locks
        self.samples: list[list[list[int]]] = []

    def sample(self) -> None:
        self.samples.append(locked_ledger_holds(self.locks))


def test_data_parallel_engines_share_one_budget(server: dict[str, Any]) -> None:
    base, locks = server["base"], server["locks"]
    first = requests.get(base + ROUTE, timeout=180).json()
    assert len(first["engines"]) == 2, first
    floor = first["autoscale"]["floor_bytes"]
    assert first["autoscale"]["shared_budget"] == BUDGET, first
    # Premise: both engine cores at their floor, each with its own live entry
    # in the one ledger of the node, and the budget holds more than both floors.
    assert limits(base) == [floor, floor] and 2 * floor < BUDGET // 2, (limits(base), floor)
    assert live_ledger_entries(locks) == 2 and len(list(locks.glob("budget-*"))) == 1, list(locks.rglob("*"))

    runs: list[CompletionLoad] = []
    with LedgerSampler(locks) as sampler:
        with on_rank(base, 0) as load:
            runs.append(load)
            wait_for(lambda: limits(base)[0] > BUDGET // 2, "rank 0 to grow past half the budget")
            assert limits(base)[1] == floor
            peak_0 = limits(base)[0]
            # Then rank 1 alone: it needs blocks while rank 0 holds most of the budget.
            with on_rank(base, 1) as load_1:
                runs.append(load_1)
                load.stop.set()  # rank 0's clients send no more; their last requests finish
                wait_for(lambda: limits(base)[1] > BUDGET // 2, "rank 1 to grow past half the budget")
                assert limits(base)[0] < peak_0
        for rank in (0, 1):
            wait_for(lambda rank=rank: limits(base)[rank] == floor, "idle engine cores at their floor")

    assert not sampler.errors, sampler.errors[:3]
    assert len(sampler.samples) > 5, len(sampler.samples)
    assert all(len(s) == 1 for s in sampler.samples), sampler.samples[:3]  # one device, one ledger
    over = [s for s in sampler.samples if sum(s[0]) > BUDGET]
    assert not over, over[:5]
    # The samples saw each rank hold most of the budget in its turn.
    assert max(max(s[0], default=0) for s in sampler.samples) > BUDGET // 2
    assert "another instance needs the shared budget" in server["log"].read_text()
    failures = [f for run in runs for f in run.failures]
    assert not failures, failures[:3]
    assert all(run.completed > 0 for run in runs), [run.completed for run in runs]
