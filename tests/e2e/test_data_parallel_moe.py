"""A mixture-of-experts model with data parallel 2 on real CPU engines. vLLM
keeps such ranks coupled (their workers join one process group), unlike a
dense model's, which run as independent engines: a capped start-up must not
wait on the start-up lock of another rank of the same group, and a resize
reaches both engine cores. (vLLM's CPU build cannot generate with it: its CPU
communicator has no ``all_gatherv`` for the experts' dispatch.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests

from tests import helpers
from tests.conftest import REPO
from tests.e2e.conftest import engine_env, server_args
from tests.e2e.test_resize import ROUTE
from tests.tiny_model import build_tiny_model

MiB = 2**20
STARTUP_BOUND_S = 240
"""Start-up takes about 40 s here. With each rank taking the lock, rank 0
waited 283 s for rank 1, which waited for rank 0 in its process group
until gloo gave up and the engine failed."""


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral"))


def test_coupled_data_parallel_ranks_start_without_deadlock_and_take_a_resize(mixtral: str, tmp_path: Path) -> None:
    spec = {
        "dp": (server_args(mixtral, "16M", None, "--data-parallel-size", "2", "--enable-kv-cache-resize"), engine_env())
    }
    with helpers.api_servers(spec, tmp_path, STARTUP_BOUND_S, REPO) as running:
        server = running["dp"]
        log = server.log_path.read_text()
        assert server.ready_s is not None, f"not ready within {STARTUP_BOUND_S} s:\n{log[-4000:]}"
        # The premise: the ranks ran coupled, as vLLM's data-parallel engine cores.
        assert re.search(r"EngineCore_DP1 pid=\d+", log), log[-4000:]
        assert len(re.findall(r"No KV cache start-up lock for data-parallel rank \d of 2", log)) == 2, log[-4000:]

        start = requests.get(server.base + ROUTE, timeout=60).json()
        assert [e["kv_cache_allocated_bytes"] for e in start["engines"]] == [16 * MiB, 16 * MiB], start

        shrunk = requests.post(server.base + ROUTE, json={"size": "8M", "mode": "preempt"}, timeout=180).json()
        assert shrunk["holds"] and [e["kv_cache_limit_bytes"] for e in shrunk["engines"]] == [8 * MiB, 8 * MiB]
        # Both workers gave the pages of the removed blocks back, each as it logs.
        fell = [int(b) for b in re.findall(r"released: RSS fell by (\d+) bytes", server.log_path.read_text())]
        assert len(fell) == 2 and min(fell) >= 0.95 * 8 * MiB, fell
        grown = requests.post(server.base + ROUTE, json={"size": "16M"}, timeout=180).json()
        assert [e["num_blocks_limit"] for e in grown["engines"]] == [
            e["num_blocks_allocated"] for e in start["engines"]
        ]


def test_external_load_balancing_each_server_resizes_its_own_rank(mixtral: str, tmp_path: Path) -> None:
    """One server per rank (``--data-parallel-rank``), started at once on one
    host: both start (each rank's engine core is coupled to the other's), and
    a resize through one server changes only its own engine core."""
    group = ("--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1")
    group += ("--data-parallel-rpc-port", str(helpers.free_port()), "--enable-kv-cache-resize")
    spec = {
        f"rank{rank}": (server_args(mixtral, "16M", None, *group, "--data-parallel-rank", str(rank)), engine_env())
        for rank in (0, 1)
    }
    with helpers.api_servers(spec, tmp_path, STARTUP_BOUND_S, REPO) as running:
        for name, server in running.items():
            assert server.ready_s is not None, (
                f"{name} not ready within {STARTUP_BOUND_S} s:\n{server.log_path.read_text()[-4000:]}"
            )
        first, second = running["rank0"].base, running["rank1"].base
        before = requests.get(second + ROUTE, timeout=60).json()
        assert "engines" not in before and before["kv_cache_allocated_bytes"] == 16 * MiB, before

        shrunk = requests.post(first + ROUTE, json={"size": "8M", "mode": "preempt"}, timeout=180).json()
        assert shrunk["holds"] and shrunk["kv_cache_limit_bytes"] == 8 * MiB and "engines" not in shrunk, shrunk
        assert shrunk["released_bytes"] >= 0.95 * 8 * MiB, shrunk
        assert requests.get(second + ROUTE, timeout=60).json() == before
