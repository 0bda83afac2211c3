"""``vllm-kv-top``'s figures, without a terminal: the instances announced in
the lock folder (``instance_entries``) and their servers' status replies, grouped by
device into one document (what ``--json`` prints and the screen shows).
Everything in an entry or a reply is untrusted (any local user may write an
entry): figures that are no byte counts are unknown, strings are made
printable before display, and the API key goes only where ``key_refusal``
allows. No vLLM import here.
"""

from __future__ import annotations

import ipaddress
import math
import unicodedata
import urllib.parse
from typing import Any

from vllm_kv_cache_limit.logic.instance_entries import Entry, label
from vllm_kv_cache_limit.logic.sizes import format_size

Status = tuple[dict[str, Any] | None, str | None]
"""A server's status reply, or why it could not be read (None, None: no server)."""


def count(value: Any) -> int | None:
    """A byte or block count from an entry or a reply: a whole number at
    least 0, else None (unknown): never NaN, infinite, negative or a string."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if value >= 0 else None


def moment(value: Any) -> float | None:
    """A time from a reply (seconds since the epoch), None unless a finite number at least 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


_UNSAFE = ("Cc", "Cf", "Cs", "Zl", "Zp")
"""Unicode categories never shown: controls (C0, DEL, C1), format characters
(bidirectional overrides), lone surrogates, line and paragraph separators."""


def printable(text: Any) -> str:
    """``text`` safe for a terminal: each character of ``_UNSAFE`` becomes
    ``?``, so an entry or a reply cannot move the cursor, set the window's
    title or hide what it says."""
    return "".join("?" if unicodedata.category(c) in _UNSAFE else c for c in str(text))


def url_problem(url: str) -> str | None:
    """Why a ``status_url`` is not read at all (not an http or https URL with a host), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        return f"status_url {url!r} is no URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"status_url {url!r} is not an http:// or https:// URL with a host"
    return None


def key_refusal(url: str, owner: int | None, uid: int) -> str | None:
    """Why the API key is not sent to ``url``, or None when it may be: only
    to an entry of this user's own (``owner``, the entry file's uid, is
    ``uid``) naming a host on the loopback (127.0.0.0/8, ::1, localhost),
    where no other host can read it. Redirects are never followed."""
    if owner != uid:
        whose = "whose owner is not known" if owner is None else f"of uid {owner}"
        return f"the key is not sent to an entry {whose}, only to this user's (uid {uid})"
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return f"the key is not sent to {host!r}, not on the loopback (127.0.0.0/8, ::1, localhost)"


def instance(entry: Entry, status: Status) -> dict[str, Any]:
    """One instance's row: what its entry says, and what its status adds
    (figures that are no counts are None: unknown)."""
    record = entry.record
    assert record is not None
    reply, error = status
    scale = (reply or {}).get("autoscale")
    if not isinstance(scale, dict):
        scale = {}
    row: dict[str, Any] = {
        "entry": entry.name,
        "label": label(record),
        "host": record["host"],
        "pid": record["pid"],
        "container": record["container"],
        "model": record["model"],
        "devices": [d["key"] for d in record["devices"]],
        "cap": count(record["cap"]),
        "floor": count(scale.get("floor_bytes", record["floor"])),
        "autoscale": record["autoscale"],
        "budget": count(record["budget"]),
        "status_url": record["status_url"],
        "status": "read" if reply is not None else ("none" if error is None else "unread"),
        "status_error": error,
        "limit": None,
        "held": None,
        "blocks_in_use": None,
        "blocks_limit": None,
        "demand_blocks": None,
        "waiting": None,
        "running": None,
        "last_change_at": None,
    }
    if reply is not None:
        row.update(
            limit=count(reply.get("kv_cache_limit_bytes")),
            held=count(scale.get("held_bytes")),
            blocks_in_use=count(reply.get("num_blocks_in_use")),
            blocks_limit=count(reply.get("num_blocks_limit")),
            demand_blocks=count(scale.get("demand_blocks")),
            waiting=count(reply.get("num_requests_waiting")),
            running=count(reply.get("num_requests_running")),
            last_change_at=moment(reply.get("last_change_at")),
        )
    return row


def document(lock_dir: str, entries: list[Entry], statuses: dict[str, Status], now: float) -> dict[str, Any]:
    """The whole view: one group per device (its shared budget, what the
    instances on it hold), the instances in each, and a line per entry file
    that is no instance's. ``statuses`` by entry name."""
    devices: dict[str, dict[str, Any]] = {}
    problems = []
    for entry in entries:
        if entry.record is None:
            problems.append(f"{lock_dir}/instances/{entry.name} {entry.problem}")
            continue
        row = instance(entry, statuses.get(entry.name, (None, None)))
        for device in entry.record["devices"] or [{"key": "unknown", "label": "devices not named"}]:
            group = devices.setdefault(
                device["key"], {"key": device["key"], "label": device["label"], "budget": None, "instances": []}
            )
            if row["budget"] is not None:
                group["budget"] = row["budget"]
            group["instances"].append(row)
    for group in devices.values():
        group["instances"].sort(key=lambda row: (row["host"], row["pid"], row["entry"]))
        holds = [row["held"] for row in group["instances"] if row["budget"] is not None]
        group["held"] = sum(h for h in holds if h is not None) if holds else None
        group["held_unknown"] = sum(1 for h in holds if h is None)
    return {
        "lock_dir": lock_dir,
        "time": round(now, 3),
        "devices": [devices[key] for key in sorted(devices)],
        "problems": problems,
    }


def size(nbytes: Any) -> str:
    """A size for a narrow column, in the binary units of the size flags
    (``48M`` is 48 MiB, as ``--kv-cache-max-memory 48M``), ``-`` when not known
    (None, or anything that is no count)."""
    value = count(nbytes)
    return "-" if value is None else format_size(value).removesuffix("iB")


def share(held: int | None, budget: int | None) -> str:
    """What an instance holds, with its share of the budget (``20MiB 50%``)."""
    if held is None:
        return "-"
    if not budget:
        return size(held)
    return f"{size(held)} {100 * held // budget}%"


def ago(at: float | None, now: float) -> str:
    """How long ago a change was (``12s``, ``5m``, ``3h``), ``-`` when never."""
    if at is None:
        return "-"
    seconds = max(0, int(now - at))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def bar(used: int, total: int, width: int) -> str:
    """A text bar of ``used`` out of ``total`` in ``width`` cells."""
    width = max(1, width)
    filled = min(width, max(0, round(width * used / total))) if total > 0 else 0
    return "#" * filled + "." * (width - filled)


def cells(row: dict[str, Any], now: float) -> dict[str, str]:
    """A row's figures as the screen writes them."""
    in_use = "-"
    if row["blocks_in_use"] is not None:
        in_use = f"{row['blocks_in_use']}/{'-' if row['blocks_limit'] is None else row['blocks_limit']}"
    return {
        "instance": row["label"] + ("" if row["status"] == "read" else " *"),
        "cap": size(row["cap"]),
        "limit": size(row["limit"]),
        "held": share(row["held"], row["budget"]),
        "floor": size(row["floor"]),
        "in use": in_use,
        "demand": "-" if row["demand_blocks"] is None else str(row["demand_blocks"]),
        "wait": "-" if row["waiting"] is None else str(row["waiting"]),
        "changed": ago(row["last_change_at"], now),
    }


def note(row: dict[str, Any]) -> str | None:
    """Why a row shows only its entry, or None when its status was read."""
    if row["status"] == "read":
        return None
    if row["status"] == "none":
        return (
            f"{row['label']}: no status route (a server started with --kv-cache-autoscale or "
            "--enable-kv-cache-resize has one); shown from its entry"
        )
    return f"{row['label']}: status not read from {row['status_url']} ({row['status_error']}); shown from its entry"
