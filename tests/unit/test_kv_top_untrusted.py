"""``vllm-kv-top`` reads a folder any local user may write to, and servers
those entries name: the API key goes only to a loopback status URL in an
entry of this user's own (never along a redirect, nor to a proxy), and
what an entry or a reply says is shown as text, never as rich markup or
terminal control sequences; a reply with figures that are no byte counts
shows them as unknown, not a traceback."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_kv_top import KEY, NODE, MiB, closed_port_url, live, status, top
from vllm_kv_cache_limit import top as kv_top_cli
from vllm_kv_cache_limit.logic import instance_entries, kv_top

pytestmark = pytest.mark.unit

NASTY = "evil\x1b[2J\x1b]0;TITLE\x1b\\\x07\x9b31m\x7f\ud800"
"""An erase-screen and a set-title sequence, BEL, a C1 CSI,
DEL and a lone surrogate: what a planted entry may hold."""


class Recorder:
    """A status server on ``host``: records each request's path and
    Authorization header; ``/redirect`` answers 302 to ``target``, every other
    path ``reply`` (or ``code`` with ``reason``)."""

    def __init__(self, host: str = "127.0.0.1", reply: Any = None, code: int = 200, reason: str = "") -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.target = ""
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                recorder.seen.append((self.path, self.headers.get("Authorization")))
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", recorder.target)
                    self.end_headers()
                    return
                body = reply if isinstance(reply, bytes) else json.dumps(reply or status(24 * MiB)).encode()
                self.send_response(code, reason or None)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.host = f"[{host}]" if ":" in host else host
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/kv_cache/max_memory") -> str:
        return f"http://{self.host}:{self.server.server_address[1]}{path}"

    def keys(self, path: str = "/kv_cache/max_memory") -> list[str | None]:
        return [key for seen, key in self.seen if seen == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[list[Recorder]]:
    made: list[Recorder] = []
    yield made
    for server in made:
        server.close()


def announced(folder: Path, *records: dict[str, Any]) -> list[instance_entries.Announcement]:
    return [instance_entries.Announcement(str(folder), r) for r in records]


def entry(url: str | None, **fields: Any) -> dict[str, Any]:
    return {**instance_entries.record([NODE], "tiny", 48 * MiB, status_url=url), **fields}


def test_the_key_rule() -> None:
    mine = os.getuid()
    for url in ("http://127.0.0.1:8000/x", "http://127.3.4.5/x", "http://[::1]:80/x", "https://LocalHost:1/x"):
        assert kv_top.key_refusal(url, mine, mine) is None, url
    for url, owner, why in [
        ("http://127.0.0.1:8000/x", mine + 1, f"uid {mine + 1}"),
        ("http://127.0.0.1:8000/x", None, "owner"),
        ("http://192.0.2.7:8000/x", mine, "not on the loopback"),
        ("http://localhost.evil.example/x", mine, "not on the loopback"),
        ("http://[::ffff:10.0.0.1]/x", mine, "not on the loopback"),
        ("http://127.0.0.1@10.0.0.1/x", mine, "not on the loopback"),
    ]:
        refusal = kv_top.key_refusal(url, owner, mine)
        assert refusal is not None and why in refusal, (url, refusal)
    assert kv_top.url_problem("http://127.0.0.1:1/x") is None
    for url in ("file:///etc/passwd", "ftp://127.0.0.1/x", "http:///x", "127.0.0.1:8000"):
        problem = kv_top.url_problem(url)
        assert problem is not None and repr(url) in problem, (url, problem)


def test_the_key_goes_only_to_loopback_entries_of_this_user(
    tmp_path: Path, servers: list[Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    good, elsewhere = Recorder(), Recorder()
    servers += [good, elsewhere]
    elsewhere.target = ""
    good.target = elsewhere.url("/stolen")
    # A proxy from the environment must not see the key either.
    monkeypatch.setenv("http_proxy", elsewhere.url("/proxy"))
    monkeypatch.setenv("HTTP_PROXY", elsewhere.url("/proxy"))
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    held = announced(tmp_path, entry(good.url()), entry(good.url("/redirect")))
    try:
        assert all(os.stat(tmp_path / instance_entries.FOLDER / a.name).st_uid == os.getuid() for a in held)
        doc = kv_top_cli.gather(str(tmp_path), KEY, 5.0)
        rows = {r["entry"]: r for g in doc["devices"] for r in g["instances"]}
        assert rows[held[0].name]["status"] == "read" and good.keys() == [f"Bearer {KEY}"]
        redirected = rows[held[1].name]
        assert redirected["status"] == "unread" and "302" in redirected["status_error"], redirected
        assert elsewhere.seen == [], elsewhere.seen  # neither the redirect's target nor the proxy
        # The same entries, read as another user would own them: no key.
        doc = kv_top_cli.gather(str(tmp_path), KEY, 5.0, uid=os.getuid() + 1)
        assert good.keys() == [f"Bearer {KEY}", None] and elsewhere.seen == []
    finally:
        for a in held:
            a.close()


@pytest.mark.skipif(os.getuid() != 0, reason="gives an entry to another user with chown, which needs root")
def test_an_entry_of_another_user_gets_no_key(tmp_path: Path, servers: list[Recorder]) -> None:
    good = Recorder()
    servers.append(good)
    held = announced(tmp_path, entry(good.url()))
    try:
        os.fchown(held[0].fd, 4242, 4242)
        result = top("--json", "--lock-dir", str(tmp_path), "--api-key", KEY)
        assert result.returncode == 0, result.stderr
        assert good.keys() == [None], good.seen
    finally:
        for a in held:
            a.close()


def non_loopback_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent; only a route is looked up
        except OSError:
            pytest.skip("this machine has no route off the loopback")
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("this machine has no address off the loopback")
    return address


def test_a_status_url_off_the_loopback_gets_no_key(tmp_path: Path, servers: list[Recorder]) -> None:
    outside = Recorder(non_loopback_address())
    servers.append(outside)
    held = announced(tmp_path, entry(outside.url()))
    try:
        result = top("--json", "--lock-dir", str(tmp_path), "--api-key", KEY)
        assert result.returncode == 0, result.stderr
        assert outside.keys() == [None], outside.seen
    finally:
        for a in held:
            a.close()


@pytest.mark.parametrize("columns", [100, 50])
def test_markup_in_an_entry_is_shown_as_written(tmp_path: Path, columns: int) -> None:
    held = announced(
        tmp_path,
        entry(closed_port_url(), host="evil[/bold]", devices=[{"key": "k", "label": "[link=http://x]dev[/link]"}]),
        entry(None, host="[bold red]planted"),
    )
    try:
        result = top("--once", "--lock-dir", str(tmp_path), columns=columns)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        flat = "".join(result.stdout.split())
        assert "evil[/bold]pid" in flat and "[boldred]plantedpid" in flat and "[link=http://x]dev[/link]" in flat
    finally:
        for a in held:
            a.close()


@pytest.mark.parametrize(
    ("where", "columns"), [("entry", 100), ("entry", 50), ("file name", 100), ("reply", 100), ("url", 100)]
)
def test_control_characters_from_entries_and_replies_never_reach_the_terminal(
    tmp_path: Path, servers: list[Recorder], where: str, columns: int
) -> None:
    server = Recorder(code=500, reason="Oops\x1b]0;TITLE\x07" if where == "reply" else "")
    servers.append(server)
    if where == "entry":
        record = entry(server.url(), host=NASTY, devices=[{"key": "k", "label": "TITLE" + NASTY}], model=NASTY)
    else:
        url = closed_port_url() + "\x1b]0;TITLE\x07" if where == "url" else server.url()
        record = entry(url)
    held = announced(tmp_path, record)
    if where == "file name":
        (tmp_path / instance_entries.FOLDER / "x\x1b]0;TITLE\x07.entry").write_text("{oops")
    try:
        result = top("--once", "--lock-dir", str(tmp_path), "--api-key", KEY, columns=columns)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        out = result.stdout
        controls = sorted({c for c in out if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F})
        assert controls == [], controls
        assert "TITLE" in "".join(out.split())  # shown, made harmless
    finally:
        for a in held:
            a.close()


BAD_FIGURES = [float("nan"), float("inf"), -float("inf"), -5, "12", True, None, [1], {"a": 1}]


@pytest.mark.parametrize("bad", BAD_FIGURES, ids=repr)
def test_a_reply_whose_figures_are_no_counts_shows_them_as_unknown(bad: Any) -> None:
    reply = status(24 * MiB, 20 * MiB, 40)
    for field in ("kv_cache_limit_bytes", "num_blocks_in_use", "num_blocks_limit", "num_requests_waiting"):
        reply[field] = bad
    reply["last_change_at"] = bad
    reply["autoscale"] = {"held_bytes": bad, "floor_bytes": bad, "demand_blocks": bad}
    row = kv_top.instance(live("a.entry", budget=40 * MiB, floor=-1, cap=-7), (reply, None))
    assert [row[k] for k in ("limit", "held", "floor", "cap", "blocks_in_use", "waiting", "last_change_at")] == [
        None
    ] * 7
    shown = kv_top.cells(row, 1000.0)
    assert all(shown[c] == "-" for c in ("cap", "limit", "held", "floor", "in use", "demand", "wait", "changed"))
    assert kv_top.size(bad) == "-"
    not_a_dict = kv_top.instance(live("b.entry"), ({**status(24 * MiB), "autoscale": [bad]}, None))
    assert not_a_dict["limit"] == 24 * MiB and not_a_dict["held"] is None


def test_a_nan_reply_on_the_command_line(tmp_path: Path, servers: list[Recorder]) -> None:
    body = json.dumps(status(24 * MiB, 20 * MiB, 40)).replace("25165824", "NaN").replace("20971520", "Infinity")
    nan = Recorder(reply=body.encode())
    servers.append(nan)
    held = announced(tmp_path, entry(nan.url(), autoscale=True, budget=40 * MiB))
    try:
        result = top("--once", "--lock-dir", str(tmp_path), "--api-key", KEY)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "budget [" in result.stdout and "0B of 40M held (1 not read)" in result.stdout, result.stdout
        result = top("--json", "--lock-dir", str(tmp_path), "--api-key", KEY)
        assert result.returncode == 0, result.stderr

        def strict(constant: str) -> None:
            raise AssertionError(f"--json printed {constant}, which is no JSON")

        doc = json.loads(result.stdout, parse_constant=strict)
        row = doc["devices"][0]["instances"][0]
        assert (row["status"], row["limit"], row["held"], row["blocks_in_use"]) == ("read", None, None, 3)
    finally:
        for a in held:
            a.close()


class _Drip(BaseHTTPRequestHandler):
    """A status server that sends its body one space at a time, for up to 30 s."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        stop = threading.Event()
        for _ in range(600):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return  # the reader gave up
            stop.wait(0.05)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_that_drips_its_reply_cannot_hold_the_screen(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    held = announced(tmp_path, entry(f"http://127.0.0.1:{server.server_address[1]}/kv_cache/max_memory"))
    done: list[dict[str, Any]] = []
    try:
        reader = threading.Thread(target=lambda: done.append(kv_top_cli.gather(str(tmp_path), KEY, 0.5)), daemon=True)
        reader.start()
        reader.join(20)
        assert done, "gather still reads a reply that never ends, 20 s after its 0.5 s --timeout"
        row = done[0]["devices"][0]["instances"][0]
        assert row["status"] == "unread" and "--timeout" in row["status_error"], row
    finally:
        for a in held:
            a.close()
        server.shutdown()
        server.server_close()
