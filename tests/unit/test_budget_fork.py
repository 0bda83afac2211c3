"""A child forked by an instance after it joined the ledger does not keep
the instance's share alive once the instance is gone (issue 49, item 5):
the entry's ``flock`` is on the open file description the child inherits,
so the child must close its copies (``Ledger.forget``, registered with
``os.register_at_fork``), or a reader sees the dead instance's entry as
live for as long as the child runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic.budget_ledger import ENTRY_SUFFIX, Ledger, folder_name

REPO = Path(__file__).resolve().parents[2]
KEY = "cpu-node0"
RECORD = {"budget": 1000, "floor": 7, "holds": 123, "wants": 0}

OWNER = textwrap.dedent(
    """
    import os, sys, time
    from vllm_kv_cache_limit.logic.budget_ledger import Ledger
    ledger = Ledger(sys.argv[1], sys.argv[2], label="owner")
    with ledger.transaction() as view:
        view.write({"budget": 1000, "floor": 7, "holds": 123, "wants": 0})
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: outlives the owner, 60 s at most
        # os.fork ran the after-fork handlers before returning here: say so,
        # or the owner could die before the child closed its copies.
        os.write(ready_w, b"1")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        time.sleep(60)
        os._exit(0)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    print("forked", pid, ledger.entry_name, flush=True)
    sys.stdin.readline()
    os._exit(0)  # dies without leaving the ledger, as after a crash: only the kernel drops its locks
    """
)


def others(ledger: Ledger) -> list[dict]:
    with ledger.transaction() as view:
        return view.others


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it holds no file)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, str]]:
    """An instance that joined the ledger in ``tmp_path`` and forked a child
    that sleeps; it exits when a line reaches its stdin. Yields it, the
    child's pid and the owner's entry name."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), KEY],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    forked = -1
    try:
        assert proc.stdout is not None
        word, pid, name = proc.stdout.readline().split()
        assert word == "forked"
        forked = int(pid)
        yield proc, forked, name
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if forked > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked, signal.SIGKILL)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_a_child_forked_after_joining_does_not_keep_a_dead_owners_entry_alive(
    tmp_path: Path, owner: tuple[subprocess.Popen[str], int, str]
) -> None:
    proc, child, name = owner
    reader = Ledger(str(tmp_path), KEY, label="reader")
    try:
        # The child closed its copies without unlocking: the owner's entry stays live.
        assert others(reader) == [{**RECORD, "label": "owner"}]
        assert proc.stdin is not None
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
        assert alive(child), "the premise: the forked child outlives the owner"
        assert (tmp_path / folder_name(KEY) / name).exists(), "the premise: the owner did not leave the ledger"
        assert others(reader) == [], "the dead owner's entry is counted while its forked child lives"
        assert alive(child)
        # Dropped by the reader, as any dead instance's entry.
        left = [p.name for p in (tmp_path / folder_name(KEY)).iterdir() if p.name.endswith(ENTRY_SUFFIX)]
        assert left == [reader.entry_name]
    finally:
        reader.close()
