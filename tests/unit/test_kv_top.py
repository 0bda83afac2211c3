"""``vllm-kv-top`` without engines: its figures grouped by device
(``logic.kv_top``), and its command line against entries this test holds and
a small status server: no vLLM import, a clear line for each bad input
(never a traceback), the API key sent, colour only on a terminal, and a
narrow window still readable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from vllm_kv_cache_limit.logic import instance_entries, kv_top

pytestmark = pytest.mark.unit

MiB = 2**20
NODE = ("cpu-node0", "host memory node 0 (CPU backend)")
KEY = "unit-test-key"


def status(limit: int, held: int | None = None, demand: int = 0) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "kv_cache_limit_bytes": limit,
        "num_blocks_limit": limit // (128 * 1024),
        "num_blocks_in_use": 3,
        "num_requests_waiting": 2,
        "num_requests_running": 1,
        "last_change_at": 1000.0,
        "autoscale": None,
    }
    if held is not None:
        reply["autoscale"] = {"held_bytes": held, "floor_bytes": 2 * MiB, "demand_blocks": demand}
    return reply


def live(name: str, **fields: Any) -> instance_entries.Entry:
    record = {**instance_entries.record([NODE], "tiny", 48 * MiB), "pid": 100 + len(name), **fields}
    return instance_entries.Entry(name, record=record)


def test_document_groups_by_device_with_the_budget_held() -> None:
    entries = [
        live("a.entry", autoscale=True, budget=40 * MiB, floor=2 * MiB, status_url="http://h/a"),
        live("b.entry", autoscale=True, budget=40 * MiB, floor=2 * MiB, status_url="http://h/b"),
        live("c.entry", cap=32 * MiB, status_url="http://h/c"),
        live("d.entry", cap=16 * MiB, devices=[{"key": "cpu-node1", "label": "node 1"}]),
        instance_entries.Entry("bad.entry", problem="is no instance entry (not JSON); remove it"),
    ]
    statuses = {
        "a.entry": (status(30 * MiB, 30 * MiB, 250), None),
        "b.entry": (status(8 * MiB, 8 * MiB), None),
        "c.entry": (None, "not answering: refused"),
    }
    doc = kv_top.document("/locks", entries, statuses, 1012.0)
    node0, node1 = doc["devices"]
    assert (node0["key"], node0["budget"], node0["held"], node0["held_unknown"]) == ("cpu-node0", 40 * MiB, 38 * MiB, 0)
    assert [r["entry"] for r in node0["instances"]] == ["a.entry", "b.entry", "c.entry"]
    assert (node1["key"], node1["budget"], node1["held"]) == ("cpu-node1", None, None)
    a, _, c = node0["instances"]
    assert (a["limit"], a["held"], a["demand_blocks"], a["waiting"], a["status"]) == (
        30 * MiB,
        30 * MiB,
        250,
        2,
        "read",
    )
    assert (c["status"], c["cap"], c["limit"], c["status_error"]) == (
        "unread",
        32 * MiB,
        None,
        "not answering: refused",
    )
    assert node1["instances"][0]["status"] == "none"
    assert doc["problems"] == ["/locks/instances/bad.entry is no instance entry (not JSON); remove it"]
    shown = kv_top.cells(a, 1012.0)
    assert shown == {
        "instance": a["label"],
        "cap": "48M",
        "limit": "30M",
        "held": "30M 75%",
        "floor": "2M",
        "in use": "3/240",
        "demand": "250",
        "wait": "2",
        "changed": "12s",
    }
    assert kv_top.cells(c, 1012.0)["instance"].endswith(" *") and "not answering" in str(kv_top.note(c))
    assert "--enable-kv-cache-resize" in str(kv_top.note(node1["instances"][0]))


def test_small_formats() -> None:
    assert kv_top.bar(10, 40, 8) == "##......" and kv_top.bar(50, 40, 4) == "####" and kv_top.bar(0, 0, 3) == "..."
    assert (kv_top.ago(None, 5), kv_top.ago(100, 10), kv_top.ago(0, 300), kv_top.ago(0, 9000)) == (
        "-",
        "0s",
        "5m",
        "2h",
    )
    assert (kv_top.share(None, 1), kv_top.share(MiB, None), kv_top.share(MiB, 4 * MiB)) == ("-", "1M", "1M 25%")


class _Status(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps(status(24 * MiB, 24 * MiB, 40)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def status_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/kv_cache/max_memory"
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/kv_cache/max_memory"


def top(*args: str, columns: int = 100, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return subprocess.run(
        [sys.executable, "-m", "vllm_kv_cache_limit.top", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**environ, "COLUMNS": str(columns), **env},
    )


@pytest.fixture
def announced(tmp_path: Path, status_server: str) -> Iterator[dict[str, Any]]:
    """Three live entries: one autoscaled whose server answers (with the
    key), one whose server does not answer, one without a server."""
    held = [
        instance_entries.Announcement(
            str(tmp_path),
            instance_entries.record([NODE], "tiny", 48 * MiB, 2 * MiB, True, 40 * MiB, status_server),
        ),
        instance_entries.Announcement(
            str(tmp_path), instance_entries.record([NODE], "tiny", 32 * MiB, status_url=closed_port_url())
        ),
        instance_entries.Announcement(str(tmp_path), instance_entries.record([NODE], "other", 16 * MiB)),
    ]
    try:
        yield {"folder": tmp_path, "names": [a.name for a in held]}
    finally:
        for a in held:
            a.close()


def _rows(stdout: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(stdout)
    return {row["entry"]: row for group in doc["devices"] for row in group["instances"]}


def test_json_reads_each_status_with_the_key(announced: dict[str, Any]) -> None:
    answering, silent, serverless = announced["names"]
    result = top("--json", "--lock-dir", str(announced["folder"]), "--api-key", KEY)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    rows = _rows(result.stdout)
    assert (rows[answering]["status"], rows[answering]["limit"], rows[answering]["held"]) == (
        "read",
        24 * MiB,
        24 * MiB,
    )
    assert rows[silent]["status"] == "unread" and rows[silent]["status_error"].startswith("not answering")
    assert rows[silent]["cap"] == 32 * MiB  # shown from its entry
    assert rows[serverless]["status"] == "none" and rows[serverless]["model"] == "other"
    # The key from the environment, as the servers take it.
    rows = _rows(top("--json", "--lock-dir", str(announced["folder"]), VLLM_API_KEY=KEY).stdout)
    assert rows[answering]["status"] == "read"
    rows = _rows(top("--json", "--lock-dir", str(announced["folder"])).stdout)
    assert rows[answering]["status"] == "unread" and "--api-key" in rows[answering]["status_error"]


def test_once_marks_what_it_could_not_read_without_colour_off_a_terminal(announced: dict[str, Any]) -> None:
    folder = announced["folder"]
    (folder / instance_entries.FOLDER / "garbage.entry").write_text("{oops")
    result = top("--once", "--lock-dir", str(folder), "--api-key", KEY)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "\x1b[" not in out and "Traceback" not in out + result.stderr
    assert "budget [" in out and "24M of 40M held" in out
    assert "INSTANCE" in out and "24M 60%" in out
    assert "status not read from http://127.0.0.1:" in out and "not answering" in out
    assert "no status route" in out
    flat = " ".join(out.split())  # long lines wrap at the window's width
    assert f"! {folder}/instances/garbage.entry is no instance entry" in flat and "'{oops'" in flat


def test_a_window_under_80_columns_shows_each_instance_as_a_block(announced: dict[str, Any]) -> None:
    result = top("--once", "--lock-dir", str(announced["folder"]), "--api-key", KEY, columns=50)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 50, result.stdout
    assert "INSTANCE" not in result.stdout
    assert sum(1 for line in lines if line.split()[:2] == ["cap", "48M"]) == 1
    assert any(line.split()[:2] == ["held", "24M"] for line in lines)


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_bad_lock_folder_is_one_line_quoting_it(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "locks"
    if kind == "file":
        folder.write_text("")
    for mode in ("--once", "--json"):
        result = top(mode, "--lock-dir", str(folder))
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith(f"vllm-kv-top: the lock folder {str(folder)!r}")
        assert "--lock-dir PATH" in result.stderr


@pytest.mark.parametrize("value", ["soon", "0", "-1", "inf"])
def test_a_bad_interval_is_one_line_quoting_it(value: str) -> None:
    result = top("--interval", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"argument --interval: {value!r} is not a number of seconds above 0, such as 1 or 0.5" in result.stderr


def test_it_imports_no_vllm_nor_torch(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "started = time.perf_counter()\n"
        "from vllm_kv_cache_limit import top\n"
        "assert top.main(['--once', '--lock-dir', sys.argv[1]]) == 0\n"
        "took = time.perf_counter() - started\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(repr((heavy, took)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    heavy, took = eval(result.stdout.strip().splitlines()[-1])
    # How soon it starts is a timing, for a benchmark, not a pass/fail bound.
    assert heavy == [], (heavy, took)
