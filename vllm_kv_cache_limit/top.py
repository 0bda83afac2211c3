"""``vllm-kv-top``: what every capped instance on this host holds, live.

Reads the instances' entries in the lock folder (``logic.instance_entries``) and
each server's ``GET /kv_cache/max_memory``, and shows them grouped by
device (``logic.kv_top``), refreshed every second; ``--once`` prints one
screen, ``--json`` one JSON document. No vLLM import: it starts in a
fraction of a second and runs where vLLM is not installed.

Any local user may write an entry, so the API key goes only to a loopback
status URL in an entry this user owns (``kv_top.key_refusal``), with no
proxy and no redirect followed, and the screen shows what entries and
replies say as plain, printable text (never rich markup).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_kv_cache_limit.logic import instance_entries, kv_top
from vllm_kv_cache_limit.logic.startup_lock import LOCK_DIR_ENV, lock_dir

PROG = "vllm-kv-top"
NARROW = 80
"""Below this many columns each instance is shown as a small block of its own."""
REPLY_BYTES = 1 << 20
"""The most of a status reply read (one is under 2 KiB); a longer one is no status."""
COLUMNS = ("instance", "cap", "limit", "held", "floor", "in use", "demand", "wait", "changed")


class Failure(Exception):
    """A problem that ends the program with one line (never a traceback)."""


def seconds(text: str) -> float:
    """A positive number of seconds (argparse quotes a bad one)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0, such as 1 or 0.5")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Show what every instance started with --kv-cache-max-memory on this host holds: per device, the "
            "shared budget and each instance's cap, limit, share, floor, blocks in use, demand and waiting "
            "requests, refreshed every second."
        ),
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON document and exit")
    parser.add_argument(
        "--lock-dir",
        default=None,
        help=f"the lock folder the servers use (their {LOCK_DIR_ENV}; default {lock_dir()})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="the servers' --api-key, to read their status (default: VLLM_API_KEY)",
    )
    parser.add_argument("--interval", type=seconds, default=1.0, help="seconds between two refreshes (default 1)")
    parser.add_argument(
        "--timeout", type=seconds, default=2.0, help="seconds to wait for a server's status (default 2)"
    )
    return parser


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follow no redirect: the status route has none, and a redirect would
    carry the key to wherever it points."""

    def redirect_request(self, *args: Any) -> None:
        return None


def _opener() -> urllib.request.OpenerDirector:
    """An opener that follows no redirect and uses no proxy (the status URL
    is one this host reaches; a proxy from the environment would see the key)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _body(reply: Any, deadline: float) -> bytes:
    """The reply's body, at most ``REPLY_BYTES`` and read by ``deadline``: a
    server that drips or floods cannot hold the screen (``TimeoutError``)."""
    body = b""
    while chunk := reply.read1(65536):
        body += chunk
        if len(body) > REPLY_BYTES:
            raise ValueError(f"a reply over {REPLY_BYTES} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError("the reply was not read within --timeout")
    return body


def read_status(url: str, api_key: str | None, timeout: float, refusal: str | None = None) -> kv_top.Status:
    """A server's status reply, or why it could not be read; the key is sent
    only when ``refusal`` (why it may not be, from ``kv_top.key_refusal``) is None."""
    problem = kv_top.url_problem(url)
    if problem is not None:
        return None, problem
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key and refusal is None:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _opener().open(request, timeout=timeout) as reply:
            body = _body(reply, time.monotonic() + timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 401 and api_key and refusal is not None:
            return None, f"HTTP 401: {refusal}"
        if exc.code == 401:
            return None, "HTTP 401: give the server's --api-key with --api-key or VLLM_API_KEY"
        if 300 <= exc.code < 400:
            return None, f"HTTP {exc.code} {exc.reason}: a redirect (to {exc.headers.get('Location')!r}), not followed"
        return None, f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        return None, f"not answering: {exc.reason}"
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a timeout, a reset, a malformed URL or reply
        return None, f"not answering: {exc}"
    try:
        value = json.loads(body)
    except ValueError:
        return None, f"not a status reply: {body[:60]!r}"
    if not isinstance(value, dict) or "kv_cache_limit_bytes" not in value:
        return None, f"not a status reply: {str(value)[:60]!r}"
    return value, None


def gather(folder: str, api_key: str | None, timeout: float, uid: int | None = None) -> dict[str, Any]:
    """The view's document: the entries, and each server's status read at
    once; the key goes only to the loopback URLs of entries that ``uid``
    (this process's by default) owns."""
    uid = os.getuid() if uid is None else uid
    try:
        entries = instance_entries.read(folder)
    except instance_entries.FolderMissing:
        raise Failure(
            f"the lock folder {folder!r} does not exist, so no capped instance runs with it. Give the folder the "
            f"servers use: --lock-dir PATH (their {LOCK_DIR_ENV}; by default {lock_dir()})."
        ) from None
    except OSError as exc:
        raise Failure(
            f"the lock folder {folder!r} cannot be read ({exc.strerror or exc}). Give a folder you may read: "
            f"--lock-dir PATH (the servers' {LOCK_DIR_ENV})."
        ) from None
    # One request per URL and refusal: the key goes with it only for the entries it may.
    asks = {
        e.name: (e.record["status_url"], kv_top.key_refusal(e.record["status_url"], e.owner, uid))
        for e in entries
        if e.record is not None and e.record["status_url"]
    }
    unique = sorted(set(asks.values()), key=lambda ask: (ask[0], ask[1] or ""))
    replies: dict[tuple[str, str | None], kv_top.Status] = {}
    if unique:
        with ThreadPoolExecutor(max_workers=min(16, len(unique))) as pool:
            for ask, reply in zip(unique, pool.map(lambda a: read_status(a[0], api_key, timeout, a[1]), unique)):
                replies[ask] = reply
    statuses = {name: replies[ask] for name, ask in asks.items()}
    return kv_top.document(folder, entries, statuses, time.time())


def render(doc: dict[str, Any], width: int) -> Any:
    """The screen for a terminal ``width`` columns wide (a rich renderable).
    Every string is a ``Text`` made printable: what an entry or a reply
    says is never read as markup nor reaches the terminal as a control."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def plain(text: Any, style: str = "") -> Text:
        return Text(kv_top.printable(text), style)

    now = doc["time"]
    parts: list[Any] = [plain(f"{PROG}  {doc['lock_dir']}  {time.strftime('%H:%M:%S', time.localtime(now))}", "bold")]
    if not doc["devices"]:
        parts.append(plain(f"No capped instance is running with the lock folder {doc['lock_dir']}."))
    notes = []
    for group in doc["devices"]:
        parts.append(Text(""))
        parts.append(plain(group["label"], "bold cyan"))
        if group["budget"]:
            held = group["held"] or 0
            cells = max(10, min(40, width - 44))
            line = Text("budget ")
            line.append(f"[{kv_top.bar(held, group['budget'], cells)}]", "green" if held <= group["budget"] else "red")
            line.append(f" {kv_top.size(held)} of {kv_top.size(group['budget'])} held")
            if group["held_unknown"]:
                line.append(f" ({group['held_unknown']} not read)")
            parts.append(line)
        rows = [kv_top.cells(row, now) for row in group["instances"]]
        if width >= NARROW:
            table = Table(
                box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True, header_style="bold"
            )
            for column in COLUMNS:
                if column == "instance":  # a long host name wraps; the figures never do
                    table.add_column(column.upper(), overflow="fold")
                else:
                    table.add_column(column.upper(), justify="right", no_wrap=True)
            for row, shown in zip(group["instances"], rows):
                table.add_row(*(plain(shown[c]) for c in COLUMNS), style=None if row["status"] == "read" else "yellow")
            parts.append(table)
        else:
            for row, shown in zip(group["instances"], rows):
                card = Table.grid(padding=(0, 1))
                for _ in range(4):
                    card.add_column()
                pairs = [(c, shown[c]) for c in COLUMNS[1:]]
                parts.append(plain(shown["instance"], "bold" if row["status"] == "read" else "bold yellow"))
                for i in range(0, len(pairs), 2):
                    left, right = pairs[i], pairs[i + 1] if i + 1 < len(pairs) else ("", "")
                    card.add_row(plain(f" {left[0]}"), plain(left[1]), plain(right[0]), plain(right[1]))
                parts.append(card)
        notes += [n for row in group["instances"] if (n := kv_top.note(row)) is not None and n not in notes]
    if notes:
        parts.append(Text(""))
        parts += [plain("* " + n, "yellow") for n in notes]
    if doc["problems"]:
        parts.append(Text(""))
        parts += [plain("! " + p, "red") for p in doc["problems"]]
    return Group(*parts)


def main(argv: list[str] | None = None) -> int:
    """The ``vllm-kv-top`` command; returns its exit status (2: a bad input, told in one line)."""
    args = build_parser().parse_args(argv)
    folder = args.lock_dir or lock_dir()
    try:
        if args.json:
            print(json.dumps(gather(folder, args.api_key, args.timeout), indent=2, sort_keys=True))
            return 0
        from rich.console import Console

        console = Console(highlight=False)
        if args.once or not console.is_terminal:
            console.print(render(gather(folder, args.api_key, args.timeout), console.width))
            return 0
        return _live(console, folder, args.api_key, args.timeout, args.interval)
    except Failure as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _live(console: Any, folder: str, api_key: str | None, timeout: float, interval: float) -> int:
    """Refresh the screen every ``interval`` seconds until interrupted."""
    from rich.live import Live

    with Live(console=console, auto_refresh=False, screen=True) as live:
        while True:
            live.update(render(gather(folder, api_key, timeout), console.width), refresh=True)
            time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main())
