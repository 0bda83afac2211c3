"""Autoscaled instances on two devices, on real CPU engines: two servers
launched at once with the same ``--kv-cache-shared-budget`` and lock
folder, B's engine core seeing its CPUs on memory node 1 (the test-only
fault plugin, applied as each interpreter starts, as for an instance
started with ``numactl --cpunodebind=1`` on a host with two nodes). The budget is per device: each takes its start-up
lock and ledger entry on its own node, neither counts the other, and under
load at once their limits add up to more than the budget while each stays
within it. A third instance on node 0 whose floor does not fit in the
budget beside A's fails at start-up, quoting both, and leaves nothing."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from tests import helpers
from tests.e2e.conftest import (
    ENGINE_TIMEOUT_S,
    FIXTURES,
    REPO,
    api_servers,
    budget_server_args,
    engine_env,
    with_plugins,
)
from tests.helpers import CompletionLoad, Periodic, live_ledger_entries
from vllm_kv_cache_limit.logic.budget_ledger import folder_name
from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.logic.startup_lock import lock_name

pytestmark = [pytest.mark.plugin_only, pytest.mark.smoke]  # autoscaling is the plugin's; every CPU build

MiB = 2**20
CAP = 40 * MiB
BUDGET = 24 * MiB
"""Less than the two servers' loads together, more than either one's alone
needs of it to pass half the budget."""
MAX_MODEL_LEN = 2048
CLIENTS = 12
PROMPT = "the quick brown fox jumps over the lazy dog " * 150
"""About 1350 tokens: with 100 generated, 12 blocks of 128 tokens a request,
so 12 clients ask for about 144 blocks (18 MiB) of KV cache, three quarters
of the budget."""
MAX_TOKENS = 100
ROUTE = "/kv_cache/max_memory"
BOUND_S = 240
NODE_A, NODE_B = "cpu-node0", "cpu-node1"


@pytest.fixture(scope="module")
def servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("devices")
    locks = folder / "locks"
    args = budget_server_args(tiny_model, CAP, BUDGET, MAX_MODEL_LEN)
    env = engine_env(
        VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks),
        PYTHONPATH=with_plugins(FIXTURES / "fault_plugin", FIXTURES / "early_faults"),
    )
    # Explicit OpenMP binds: vLLM's automatic one picks the CPUs of the
    # visible node 0, and B's engine core sees none there.
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    binds = (cores[:half], cores[half:] or cores[:half])
    env_a = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, binds[0]))}
    env_b = {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, binds[1])), "KVCL_TEST_MEMORY_NODE": "1"}
    with api_servers({"a": (args, env_a), "b": (args, env_b)}, folder) as running:
        yield {"servers": running, "locks": locks, "args": args, "env": env_a, "folder": folder}


def status(base: str) -> dict[str, Any]:
    reply = requests.get(base + ROUTE, timeout=180)
    assert reply.status_code == 200, reply.text
    return reply.json()


class Sampler(Periodic):
    """Both servers' limits and the others each sees, every half second."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(0.5)
        self.a, self.b = a, b
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> None:
        a, b = status(self.a), status(self.b)
        self.samples.append(
            {
                "a": a["kv_cache_limit_bytes"],
                "b": b["kv_cache_limit_bytes"],
                "others": len(a["autoscale"]["others"]) + len(b["autoscale"]["others"]),
            }
        )


def test_instances_on_two_devices_each_have_the_whole_budget(servers: dict[str, Any]) -> None:
    a, b = (servers["servers"][name][0] for name in ("a", "b"))
    log_b = servers["servers"]["b"][1]
    locks: Path = servers["locks"]
    first_a, first_b = status(a)["autoscale"], status(b)["autoscale"]
    # The premise: each instance is on its own node, and only there.
    assert first_a["devices"] == ["host memory node 0 (CPU backend)"], first_a
    assert first_b["devices"] == ["host memory node 1 (CPU backend)"], first_b
    assert "shared budget 24MiB of host memory node 1 (CPU backend), others hold 0B (none)" in log_b.read_text()
    assert {p.name for p in locks.glob("*.lock")} >= {lock_name(NODE_A), lock_name(NODE_B)}
    for node in (NODE_A, NODE_B):
        assert live_ledger_entries(locks, folder_name(node)) == 1, sorted(locks.rglob("*"))
    assert first_a["others"] == [] and first_b["others"] == []

    with Sampler(a, b) as sampler:
        loads = [CompletionLoad(base, CLIENTS, PROMPT, MAX_TOKENS) for base in (a, b)]
        for load in loads:
            load.__enter__()
        try:
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline and not any(s["a"] + s["b"] > BUDGET for s in list(sampler.samples)):
                time.sleep(0.5)
        finally:
            for load in loads:
                load.__exit__(None, None, None)
    samples = sampler.samples
    assert samples and not sampler.errors, sampler.errors
    # One budget per device: together they passed it, each within it.
    assert any(s["a"] + s["b"] > BUDGET for s in samples), samples[-5:]
    assert all(max(s["a"], s["b"]) <= BUDGET for s in samples), samples
    assert all(s["others"] == 0 for s in samples), samples
    for load in loads:
        assert load.failures == [] and load.done, load.failures[:3]


def test_a_floor_that_does_not_fit_beside_the_others_fails_at_start_up(servers: dict[str, Any]) -> None:
    a = servers["servers"]["a"][0]
    locks: Path = servers["locks"]
    floor_a = status(a)["autoscale"]["floor_bytes"]
    floor_c = 23 * MiB
    # The premise: C's floor fits its cap and the budget alone, not beside A's.
    assert floor_c <= BUDGET < floor_c + floor_a, floor_a
    args = [*servers["args"], "--kv-cache-min-memory", "23M"]
    with helpers.api_servers({"c": (args, servers["env"])}, servers["folder"], ENGINE_TIMEOUT_S, REPO) as running:
        c = running["c"]
        log = c.log_path.read_text()
        assert c.ready_s is None and c.returncode not in (None, 0), log[-3000:]
        # Said once: the API server's error, not also the engine core's traceback, printed twice.
        assert log.count("Traceback (most recent call last)") == 1, log[-6000:]
        assert "ERROR" in log and "EngineCore failed to start: --kv-cache-shared-budget 24MiB" in log, log[-3000:]
        least = floor_c + floor_a
        assert (
            f"--kv-cache-shared-budget 24MiB ({BUDGET} bytes) is below the floors of the instances on host memory "
            f"node 0 (CPU backend): this one's 23MiB and 1 other(s)' {format_size(floor_a)}"
        ) in log, log[-3000:]
        # The suggestion is a size that is accepted: at least the floors, as written.
        suggested = re.search(r"Give a budget of at least (\S+) \((\d+) bytes\)", log)
        assert suggested and int(suggested[2]) == least and parse_size(suggested[1]) >= least, log[-3000:]
        assert c.pid is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _in_group(c.pid):
            time.sleep(0.5)
        assert not _in_group(c.pid), "processes of the refused server are left"
    # Nothing of C is left in the ledger, and A and B keep theirs.
    for node in (NODE_A, NODE_B):
        assert live_ledger_entries(locks, folder_name(node)) == 1, sorted(locks.rglob("*"))
    assert status(a)["autoscale"]["others"] == []


def _in_group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (OSError, psutil.Error):
            continue
    return found
