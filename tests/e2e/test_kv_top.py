"""``vllm-kv-top`` on real CPU engines: two servers autoscaled under one
shared budget (A, B) and a third with a static cap and ``--api-key`` (C),
started once for the module with one lock folder. ``--json`` lists all three
with their caps and devices (C only with its key); load on A shows A's limit
and held share rising; in a real terminal (``tmux``) the live view shows the
three instances and the budget bar, and a window under 80 columns a table
that still reads; killed with SIGKILL, B leaves the view within
``GONE_BOUND_S``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers
from tests.conftest import REPO
from tests.e2e.conftest import ENGINE_TIMEOUT_S, budget_server_args, engine_env, server_args

pytestmark = [pytest.mark.plugin_only]  # announcements and the view are the plugin's

MiB = 2**20
CAP = 48 * MiB
STATIC_CAP = 32 * MiB
BUDGET = 40 * MiB
MAX_MODEL_LEN = 2048
API_KEY = "kv-top-test-key"
CLIENTS = 8
PROMPT = "the quick brown fox jumps over the lazy dog " * 150
"""About 1350 tokens: 8 clients ask for about 96 blocks, far above A's floor of 17."""
MAX_TOKENS = 100
BOUND_S = 180
"""What a change of limit under load may take on the 2-core test machine."""
GONE_BOUND_S = 10
"""The bound stated for an instance killed with SIGKILL to leave the view: the
kernel drops its entry's lock as its processes exit, so the first run of
vllm-kv-top after that no longer lists it; 10 s covers the exit and one run
on a loaded 2-core machine."""
NARROW = 60


@pytest.fixture(scope="module")
def three(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("kv-top")
    locks = folder / "locks"
    env = engine_env(VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks), VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S="5")
    env.pop("VLLM_API_KEY", None)
    envs = [dict(env), dict(env), dict(env)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # A and C on one half of the cores, B on the other: loaded A never starves B
        half = len(cores) // 2
        for e, part in zip(envs, (cores[:half], cores[half:], cores[:half])):
            e["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, part))
    autoscaled = budget_server_args(tiny_model, CAP, BUDGET, MAX_MODEL_LEN)
    static = server_args(tiny_model, f"{STATIC_CAP // MiB}M", None, "--enable-kv-cache-resize", "--api-key", API_KEY)
    specs = {"a": (autoscaled, envs[0]), "b": (autoscaled, envs[1]), "c": (static, envs[2])}
    with helpers.api_servers(specs, folder, ENGINE_TIMEOUT_S, REPO) as running:
        for name, server in running.items():
            if server.ready_s is None:
                pytest.fail(f"server {name} did not start:\n{server.log_path.read_text()[-4000:]}")
        yield {"servers": running, "locks": locks, "folder": folder}


def top(locks: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_kv_cache_limit.top", "--lock-dir", str(locks), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"},
    )


def view(locks: Path, key: str | None = API_KEY) -> dict[str, Any]:
    """``vllm-kv-top --json``, with each instance once by its server's port."""
    result = top(locks, "--json", *(["--api-key", key] if key else []))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows: dict[str, Any] = {}
    for group in doc["devices"]:
        for row in group["instances"]:
            rows[row["status_url"] or row["entry"]] = {**row, "group": group}
    return {"doc": doc, "rows": rows}


def row_of(seen: dict[str, Any], base: str) -> dict[str, Any] | None:
    return next((row for url, row in seen["rows"].items() if url.startswith(base + "/")), None)


def wait_for(condition: Callable[[], Any], what: str, timeout: float, last: list[str] | None = None) -> Any:
    """Poll ``condition`` until it returns something true, at most ``timeout``
    seconds; ``last``: what the failure shows (the last screen seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f":\n{last[0]}" if last else ""))


def test_json_lists_the_three_with_their_caps_and_devices(three: dict[str, Any]) -> None:
    servers, locks = three["servers"], three["locks"]
    # Every server tells its engine core its URL as it starts serving.

    def all_three() -> dict[str, Any] | None:
        seen = view(locks)
        return seen if all(row_of(seen, s.base) for s in servers.values()) else None

    seen = wait_for(all_three, "the three servers' URLs in their entries", 60)
    assert len(seen["rows"]) == 3, seen["doc"]
    a, b, c = (row_of(seen, servers[name].base) for name in "abc")
    assert a and b and c
    assert (a["cap"], b["cap"], c["cap"]) == (CAP, CAP, STATIC_CAP)
    assert a["autoscale"] and b["autoscale"] and not c["autoscale"]
    assert a["budget"] == b["budget"] == BUDGET and c["budget"] is None
    nodes = sorted(f"cpu-node{n}" for n in _numa_nodes())
    for row in (a, b, c):
        assert row["status"] == "read", row
        assert sorted(row["devices"]) == nodes, row
        assert row["model"] == "tiny" and row["blocks_limit"] and row["limit"]
    assert c["limit"] <= STATIC_CAP and c["floor"] is None
    assert a["floor"] and a["limit"] >= a["floor"] and a["held"] is not None
    for group in seen["doc"]["devices"]:
        assert group["budget"] == BUDGET and group["held"] == a["held"] + b["held"] <= BUDGET, group

    # Without the key, C's status is refused: C is still listed, from its entry, and marked.
    unkeyed = view(locks, None)
    c_unkeyed = row_of(unkeyed, servers["c"].base)
    assert c_unkeyed is not None and c_unkeyed["status"] == "unread" and c_unkeyed["cap"] == STATIC_CAP
    assert "401" in c_unkeyed["status_error"], c_unkeyed
    assert row_of(unkeyed, servers["a"].base)["status"] == "read"  # type: ignore[index]


def _numa_nodes() -> set[int]:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

    return {cpu.numa_node for cpu in get_allowed_cpu_list()}


def test_load_on_one_shows_its_limit_and_share_rising(three: dict[str, Any]) -> None:
    servers, locks = three["servers"], three["locks"]
    base = servers["a"].base
    before = row_of(view(locks), base)
    assert before is not None and before["held"] is not None

    def rising() -> dict[str, Any] | None:
        row = row_of(view(locks), base)
        return row if row and row["limit"] > before["limit"] and row["held"] > before["held"] else None

    with helpers.CompletionLoad(base, CLIENTS, PROMPT, MAX_TOKENS) as load:
        during = wait_for(rising, "A's limit and held share to rise under load", BOUND_S)
    assert not load.failures, load.failures[:3]
    assert during["demand_blocks"] > 0, during
    assert during["last_change_at"] is not None and during["held"] <= BUDGET


def _tmux() -> list[str]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed; the live view's test needs it")
    return ["tmux", "-L", f"kv-top-{os.getpid()}", "-f", "/dev/null"]


def _screen(tmux: list[str], session: str) -> str:
    return subprocess.run(
        [*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, timeout=30, check=True
    ).stdout


def test_live_view_in_tmux_shows_the_three_and_the_budget_bar(three: dict[str, Any]) -> None:
    servers, locks = three["servers"], three["locks"]
    labels = [r["label"] for r in view(locks)["rows"].values()]
    assert len(labels) == 3
    tmux, session = _tmux(), f"top-{uuid.uuid4().hex[:8]}"
    command = " ".join(
        shlex.quote(part)
        for part in [
            "env",
            "-u",
            "COLUMNS",  # the terminal's size, not a size handed down, sets the layout
            "-u",
            "LINES",
            f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
            sys.executable,
            "-m",
            "vllm_kv_cache_limit.top",
            "--lock-dir",
            str(locks),
            "--api-key",
            API_KEY,
        ]
    )
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "120", "-y", "50", "-c", str(REPO), command], check=True
    )
    try:
        budget_bar = re.compile(r"budget \[[#.]+\] \S+ of 40M held")

        shown: list[str] = [""]

        def wide() -> str | None:
            text = shown[0] = _screen(tmux, session)
            return text if all(label in text for label in labels) and budget_bar.search(text) else None

        screen = wait_for(wide, "the live view with the three instances and the budget bar", 30, shown)
        header = next(line for line in screen.splitlines() if "INSTANCE" in line)
        assert all(column in header for column in ("CAP", "LIMIT", "HELD", "FLOOR", "IN USE", "DEMAND", "WAIT"))
        assert f"{servers['c'].base}" not in screen  # the three were read: no "status not read" note
        subprocess.run([*tmux, "resize-window", "-t", session, "-x", str(NARROW), "-y", "60"], check=True)

        def narrow() -> str | None:
            text = shown[0] = _screen(tmux, session)
            lines = text.splitlines()
            whole = all(any(line.strip() == label for line in lines) for label in labels)
            return text if whole and "INSTANCE" not in text and budget_bar.search(text) else None

        screen = wait_for(narrow, f"the view redrawn for {NARROW} columns", 30, shown)
        # Every instance's figures still read as name and value, none cut off.
        assert len(re.findall(r"\bcap\s+48M\b", screen)) == 2 and len(re.findall(r"\bcap\s+32M\b", screen)) == 1
        assert len(re.findall(r"\blimit\s+\d", screen)) == 3 and len(re.findall(r"\bin use\s+\d+/\d+", screen)) == 3
        assert max(len(line.rstrip()) for line in screen.splitlines()) <= NARROW
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=30)


def test_an_instance_killed_with_sigkill_leaves_the_view(three: dict[str, Any]) -> None:
    """Last: it ends B."""
    servers, locks = three["servers"], three["locks"]
    b = servers["b"]
    assert row_of(view(locks), b.base) is not None
    assert b.pid is not None
    os.killpg(b.pid, signal.SIGKILL)
    killed = time.monotonic()

    def without_b() -> dict[str, Any] | None:
        seen = view(locks)
        return seen if row_of(seen, b.base) is None else None

    seen = wait_for(without_b, "B to leave the view", GONE_BOUND_S)
    took = time.monotonic() - killed
    assert len(seen["rows"]) == 2 and not seen["doc"]["problems"], seen["doc"]
    assert took <= GONE_BOUND_S
