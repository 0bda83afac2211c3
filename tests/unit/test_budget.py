"""The ledger of a device's shared budget (``budget``): live entries seen
across objects and processes, dead ones dropped by their lock alone (no pid
compared), and a folder that cannot be redirected or tampered with."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic.budget_ledger import ENTRY_SUFFIX, LEDGER_LOCK, Ledger, folder_name
from vllm_kv_cache_limit.logic.startup_lock import LockSetupError

REPO = Path(__file__).resolve().parents[2]
KEY = "cpu-node0"

CHILD = textwrap.dedent(
    """
    import sys, time
    from vllm_kv_cache_limit.logic.budget_ledger import Ledger
    ledger = Ledger(sys.argv[1], sys.argv[2], label=sys.argv[3])
    with ledger.transaction() as view:
        view.write({"budget": 1000, "holds": 123, "wants": 456, "floor": 7})
    print("ready", flush=True)
    time.sleep(120)
    """
)


def rec(holds: int, wants: int = 0, floor: int = 0) -> dict[str, int]:
    """An instance's record (the ledger skips any other)."""
    return {"budget": 1000, "floor": floor, "holds": holds, "wants": wants}


def entries(folder: Path, key: str = KEY) -> list[str]:
    return sorted(p.name for p in (folder / folder_name(key)).iterdir() if p.name.endswith(ENTRY_SUFFIX))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def others(ledger: Ledger) -> list[dict]:
    with ledger.transaction() as view:
        return view.others


@pytest.fixture
def ledgers() -> Iterator[list[Ledger]]:
    """Ledgers a test opens, closed after it."""
    opened: list[Ledger] = []
    yield opened
    for ledger in opened:
        ledger.close()


def open_ledger(ledgers: list[Ledger], folder: Path, label: str, key: str = KEY) -> Ledger:
    ledger = Ledger(str(folder), key, label=label)
    ledgers.append(ledger)
    return ledger


@pytest.fixture
def child(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A process that joins the ledger in ``tmp_path``, writes its record and
    sleeps, labelled with this test process's pid (a live one)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), KEY, f"child labelled pid {os.getpid()}"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail (instead of hanging) a test whose ledger read blocks."""

    def expire(signum, frame):
        raise TimeoutError("the ledger read blocked")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_two_ledgers_in_one_process_see_each_other(tmp_path: Path, ledgers: list[Ledger]) -> None:
    a = open_ledger(ledgers, tmp_path, "a")
    b = open_ledger(ledgers, tmp_path, "b")
    with a.transaction() as view:
        assert view.others == []
        view.write(rec(10, 20, 1))
    with b.transaction() as view:
        assert view.others == [{**rec(10, 20, 1), "label": "a"}]
        view.write(rec(30, 40, 2))
    assert others(a) == [{**rec(30, 40, 2), "label": "b"}]
    # A later write replaces the entry (a shorter record leaves nothing of the old one).
    with a.transaction() as view:
        view.write(rec(5))
    assert others(b) == [{**rec(5), "label": "a"}]
    assert a.record == rec(5)
    assert len(entries(tmp_path)) == 2


def test_a_ledger_sees_every_other_but_not_itself(tmp_path: Path, ledgers: list[Ledger]) -> None:
    names = ["a", "b", "c", "d"]
    opened = [open_ledger(ledgers, tmp_path, name) for name in names]
    for i, ledger in enumerate(opened):
        with ledger.transaction() as view:
            view.write(rec(i))
    for i, ledger in enumerate(opened):
        seen = sorted((o["label"], o["holds"]) for o in others(ledger))
        assert seen == [(n, j) for j, n in enumerate(names) if j != i]


def test_devices_have_separate_ledgers(tmp_path: Path, ledgers: list[Ledger]) -> None:
    a = open_ledger(ledgers, tmp_path, "a", key="GPU-aaa")
    b = open_ledger(ledgers, tmp_path, "b", key="GPU-bbb")
    with a.transaction() as view:
        view.write(rec(1))
    assert others(b) == []
    assert (tmp_path / "budget-GPU-aaa").is_dir() and (tmp_path / "budget-GPU-bbb").is_dir()


def test_a_child_entry_is_seen_while_it_lives_and_dropped_once_killed(
    tmp_path: Path, ledgers: list[Ledger], child: subprocess.Popen
) -> None:
    me = open_ledger(ledgers, tmp_path, "parent")
    (child_entry,) = entries(tmp_path)  # the parent's entry is created in its first transaction
    expected = {**rec(123, 456, 7), "label": f"child labelled pid {os.getpid()}"}
    assert others(me) == [expected]
    assert others(me) == [expected]  # a live entry stays
    assert entries(tmp_path) == sorted([child_entry, me.entry_name])
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    # The record names a live pid (this process's): only the lock counts.
    assert others(me) == []
    assert entries(tmp_path) == [me.entry_name]
    assert not (tmp_path / folder_name(KEY) / child_entry).exists()


def test_a_left_over_unlocked_entry_is_ignored_and_removed(tmp_path: Path, ledgers: list[Ledger]) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    stale = tmp_path / folder_name(KEY) / f"0123456789abcdef{ENTRY_SUFFIX}"
    # Written by an instance that died; it names this (live) process.
    stale.write_text(json.dumps({**rec(99), "label": f"{socket.gethostname()} pid {os.getpid()}"}))
    assert others(me) == []
    assert not stale.exists()


def test_a_held_but_unreadable_entry_is_not_counted(tmp_path: Path, ledgers: list[Ledger]) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    garbage = tmp_path / folder_name(KEY) / f"garbage{ENTRY_SUFFIX}"
    garbage.write_text("not json")
    with open(garbage, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert others(me) == []
        assert garbage.exists()  # its owner lives: left alone


def test_close_removes_the_entry(tmp_path: Path, ledgers: list[Ledger]) -> None:
    a = open_ledger(ledgers, tmp_path, "a")
    b = open_ledger(ledgers, tmp_path, "b")
    with a.transaction() as view:
        view.write(rec(10))
    name = a.entry_name
    assert (tmp_path / folder_name(KEY) / name).exists()
    assert [o["label"] for o in others(b)] == ["a"]
    a.close()
    assert not (tmp_path / folder_name(KEY) / name).exists()
    assert others(b) == []
    assert entries(tmp_path) == [b.entry_name]
    a.close()  # twice: harmless
    assert a.entry_fd == a.lock_fd == a.dir_fd == -1


def test_the_default_label_names_the_host_and_pid(tmp_path: Path, ledgers: list[Ledger]) -> None:
    a = open_ledger(ledgers, tmp_path, "")
    b = open_ledger(ledgers, tmp_path, "b")
    with a.transaction() as view:
        view.write(rec(1))
    (record,) = others(b)
    assert record["label"] == a.label
    assert socket.gethostname() in a.label and f"pid {os.getpid()}" in a.label


def test_close_before_joining_leaves_nothing(tmp_path: Path) -> None:
    ledger = Ledger(str(tmp_path), KEY, label="x")
    ledger.close()
    assert entries(tmp_path) == []


def test_a_new_budget_folder_is_shared_and_sticky(tmp_path: Path, ledgers: list[Ledger]) -> None:
    folder = tmp_path / "locks"
    open_ledger(ledgers, folder, "a")
    sub = folder / folder_name(KEY)
    assert sub.name == "budget-cpu-node0"
    assert stat.S_IMODE(sub.stat().st_mode) == 0o1777
    assert stat.S_IMODE((sub / LEDGER_LOCK).stat().st_mode) == 0o666


def test_folder_names_are_plain() -> None:
    assert folder_name("GPU-1a2b-3c") == "budget-GPU-1a2b-3c"
    assert folder_name("../../etc") == "budget-.._.._etc"


def test_a_symlink_planted_as_the_budget_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / folder_name(KEY)).symlink_to(elsewhere)
    with pytest.raises(LockSetupError, match="not a plain folder") as info:
        Ledger(str(tmp_path), KEY, label="x")
    assert str(tmp_path / folder_name(KEY)) in str(info.value)
    assert list(elsewhere.iterdir()) == []


def test_a_dangling_symlink_planted_as_the_budget_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / folder_name(KEY)).symlink_to(tmp_path / "missing")
    with pytest.raises(LockSetupError, match="not a plain folder"):
        Ledger(str(tmp_path), KEY, label="x")
    assert not (tmp_path / "missing").exists()


def test_a_file_planted_as_the_budget_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / folder_name(KEY)).write_text("")
    with pytest.raises(LockSetupError, match="not a plain folder"):
        Ledger(str(tmp_path), KEY, label="x")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o770, 0o757, 0o2777, 0o2707])
def test_a_budget_folder_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path, mode: int) -> None:
    sub = tmp_path / folder_name(KEY)
    sub.mkdir()
    sub.chmod(mode)
    before = open_fds()
    with pytest.raises(LockSetupError, match=f"mode {mode:o}") as info:
        Ledger(str(tmp_path), KEY, label="x")
    assert "sticky" in str(info.value) and str(sub) in str(info.value)
    assert list(sub.iterdir()) == []  # nothing created in it
    assert open_fds() == before


@pytest.mark.parametrize("mode", [0o1777, 0o1770, 0o755, 0o700, 0o2770, 0o3770, 0o2750])
def test_a_sticky_or_private_budget_folder_is_accepted(tmp_path: Path, ledgers: list[Ledger], mode: int) -> None:
    sub = tmp_path / folder_name(KEY)
    sub.mkdir()
    sub.chmod(mode)
    ledger = open_ledger(ledgers, tmp_path, "x")
    with ledger.transaction() as view:
        view.write(rec(1))
    assert entries(tmp_path) == [ledger.entry_name]


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_lock_folder_others_may_rename_entries_in_is_refused_for_the_budget_too(tmp_path: Path, mode: int) -> None:
    """One rule for the lock folder and the budget folder in it."""
    top = tmp_path / "locks"
    top.mkdir()
    top.chmod(mode)
    with pytest.raises(
        LockSetupError, match=f"the lock folder {re.escape(str(top))} is writable by .*\\(mode {mode:o}\\)"
    ):
        Ledger(str(top), KEY, label="x")
    assert list(top.iterdir()) == []  # no budget folder made in it


def test_a_planted_symlink_entry_is_not_followed_nor_counted(
    tmp_path: Path, ledgers: list[Ledger], no_hang: None
) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    sub = tmp_path / folder_name(KEY)
    # A record that would count if followed: its target is locked, as a live entry's is.
    victim = tmp_path / "victim.entry"
    victim.write_text(json.dumps({**rec(10**12, 10**12), "label": "planted"}))
    (sub / f"x{ENTRY_SUFFIX}").symlink_to(victim)
    with open(victim, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert others(me) == []
    # Unlocked, it would be taken for a dead entry if followed: still ignored.
    assert others(me) == []
    assert victim.exists()
    assert json.loads(victim.read_text())["label"] == "planted"


def test_a_planted_fifo_entry_is_ignored_without_blocking(tmp_path: Path, ledgers: list[Ledger], no_hang: None) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    other = open_ledger(ledgers, tmp_path, "other")
    with other.transaction() as view:
        view.write(rec(3))
    fifo = tmp_path / folder_name(KEY) / f"y{ENTRY_SUFFIX}"
    os.mkfifo(fifo)
    assert others(me) == [{**rec(3), "label": "other"}]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_planted_folder_entry_is_ignored(tmp_path: Path, ledgers: list[Ledger]) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    (tmp_path / folder_name(KEY) / f"z{ENTRY_SUFFIX}").mkdir()
    assert others(me) == []


def test_other_files_in_the_folder_are_not_entries(tmp_path: Path, ledgers: list[Ledger]) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    note = tmp_path / folder_name(KEY) / "notes.txt"
    note.write_text(json.dumps(rec(1)))
    assert others(me) == []
    assert note.exists()  # not an entry: not removed either


def test_a_symlink_planted_as_the_ledger_lock_is_refused(tmp_path: Path) -> None:
    sub = tmp_path / folder_name(KEY)
    sub.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    victim.chmod(0o600)
    (sub / LEDGER_LOCK).symlink_to(victim)
    before = open_fds()
    with pytest.raises(LockSetupError, match="ledger lock .* is not a regular file") as info:
        Ledger(str(tmp_path), KEY, label="x")
    assert str(sub / LEDGER_LOCK) in str(info.value)
    assert victim.read_text() == "precious"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600  # not made 0666 through the link
    assert open_fds() == before  # the folder's descriptor closed too


def test_a_fifo_planted_as_the_ledger_lock_is_refused(tmp_path: Path, no_hang: None) -> None:
    sub = tmp_path / folder_name(KEY)
    sub.mkdir(mode=0o755)
    os.mkfifo(sub / LEDGER_LOCK)
    with pytest.raises(LockSetupError, match="is not a regular file"):
        Ledger(str(tmp_path), KEY, label="x")


def test_a_folder_planted_as_the_ledger_lock_is_refused(tmp_path: Path) -> None:
    sub = tmp_path / folder_name(KEY)
    sub.mkdir(mode=0o755)
    (sub / LEDGER_LOCK).mkdir()
    before = open_fds()
    try:
        with pytest.raises(LockSetupError, match="is not a regular file"):
            Ledger(str(tmp_path), KEY, label="x")
    finally:
        leaked = open_fds() - before
    assert leaked == 0


def test_records_too_large_are_refused(tmp_path: Path, ledgers: list[Ledger]) -> None:
    me = open_ledger(ledgers, tmp_path, "me")
    with me.transaction() as view:
        with pytest.raises(ValueError, match="over 4096"):
            view.write({"label_padding": "x" * 5000})
