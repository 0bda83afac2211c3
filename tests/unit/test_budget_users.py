"""A budget shared by users whose umask is 077: the files one user's
instance creates in the lock folder (its ledger entry, its announcement)
are read by another user's. The other users are a forked child that drops
to an account without privileges (root only; skipped with the reason
elsewhere)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_kv_cache_limit.logic import instance_entries
from vllm_kv_cache_limit.logic.budget_ledger import ENTRY_SUFFIX, LEDGER_LOCK, Ledger, folder_name

KEY = "cpu-node0"
NOBODY = 65534
SECOND = 65533
"""Two ids without privileges (``nobody``, and one below it no file here belongs to)."""


@pytest.fixture
def locks() -> Iterator[Path]:
    """A lock folder other users may reach, the test's umask 077."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as other users (setuid in a forked child)")
    base = Path(tempfile.mkdtemp(prefix="kvcl-umask-", dir="/tmp"))
    base.chmod(0o755)
    previous = os.umask(0o077)
    try:
        yield base / "locks"
    finally:
        os.umask(previous)
        shutil.rmtree(base, ignore_errors=True)


class Child:
    """A forked child running ``work`` as ``uid``; it answers one JSON line
    and, when told to hold, keeps what it opened until :meth:`finish`."""

    def __init__(self, uid: int, work: Callable[[], Any], hold: bool = False) -> None:
        answer_r, answer_w = os.pipe()
        go_r, go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(answer_r)
                os.close(go_w)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                try:
                    reply = {"ok": work()}
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                os.write(answer_w, json.dumps(reply, default=str).encode() + b"\n")
                if hold:
                    os.read(go_r, 1)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(answer_w)
        os.close(go_r)
        self.answer = os.fdopen(answer_r)
        self.go = go_w

    def reply(self) -> dict[str, Any]:
        line = self.answer.readline()  # bounded: the child answers or exits, closing the pipe
        assert line, "the child exited without answering"
        return json.loads(line)

    def finish(self) -> None:
        os.close(self.go)
        self.answer.close()
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def join(folder: Path, label: str, holds: int) -> Callable[[], Any]:
    """Join the ledger, write an entry and return the others' labels
    (the ledger is kept open: the child holds its entry until it ends)."""

    def work() -> list[str]:
        ledger = Ledger(str(folder), KEY, label=label)
        with ledger.transaction(wait=5.0) as view:
            view.write({"instance": label, "budget": 1000, "floor": 1, "holds": holds, "wants": holds})
            return sorted(o["label"] for o in view.others)

    return work


def test_users_with_umask_077_read_each_others_entries(locks: Path) -> None:
    mine = Ledger(str(locks), KEY, label="root's instance")
    shown = instance_entries.Announcement(str(locks), instance_entries.record([(KEY, "node 0")], "model", cap=1 << 20))
    try:
        with mine.transaction() as view:
            view.write({"instance": "root", "budget": 1000, "floor": 1, "holds": 10, "wants": 10})
        folder = locks / folder_name(KEY)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert modes == {mine.entry_name: 0o644, LEDGER_LOCK: 0o666}, modes
        assert stat.S_IMODE((locks / instance_entries.FOLDER / shown.name).stat().st_mode) == 0o644
        first = Child(NOBODY, join(locks, "nobody's instance", 20), hold=True)
        try:
            assert first.reply() == {"ok": ["root's instance"]}
            # A second user sees the first one's entry, created under its umask 077 too.
            second = Child(SECOND, join(locks, "second user's instance", 30))
            try:
                assert second.reply() == {"ok": ["nobody's instance", "root's instance"]}
            finally:
                second.finish()
            entries = sorted(p for p in folder.iterdir() if p.name.endswith(ENTRY_SUFFIX))
            assert {(p.stat().st_uid, stat.S_IMODE(p.stat().st_mode)) for p in entries} == {
                (0, 0o644),
                (NOBODY, 0o644),
                (SECOND, 0o644),  # gone with its process: left for the next reader to remove
            }
        finally:
            first.finish()

        def top() -> list[Any]:  # what vllm-kv-top reads
            return [(e.record or {}).get("pid") or e.problem for e in instance_entries.read(str(locks))]

        listed = Child(NOBODY, top)
        try:
            assert listed.reply() == {"ok": [os.getpid()]}
        finally:
            listed.finish()
    finally:
        shown.close()
        mine.close()
