"""A killed engine core's ledger entry stays counted until its workers have
exited (found by the fault soak, benchmarks/soak.py: after a SIGKILL of an
instance's process group its workers ran on for up to 12.8 s, freeing their
memory, while the entry went with the engine core's lock at once). Each
worker holds a companion of the entry (``budget_ledger.Companions``), whose
lock the kernel drops only as the worker exits; a reader counts an entry
while its engine core or one of its workers lives. The stand-ins are real
processes: the engine core's, and a worker's spawned apart from it (as
vLLM's are) that forks a child of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.test_budget_fork import KEY, RECORD, REPO, alive, others
from vllm_kv_cache_limit.logic.budget_ledger import COMPANION_INFIX, ENTRY_SUFFIX, Companions, Ledger, folder_name

ENGINE_CORE = textwrap.dedent(
    """
    import json, os, sys
    from vllm_kv_cache_limit.logic.budget_ledger import Ledger
    ledger = Ledger(sys.argv[1], sys.argv[2], label="owner")
    with ledger.transaction() as view:  # the record of RECORD, in argv[3]
        view.write(json.loads(sys.argv[3]))
    print(ledger.entry_name, flush=True)
    sys.stdin.readline()
    os._exit(0)  # dies without leaving the ledger, as after a SIGKILL: only the kernel drops its lock
    """
)

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from vllm_kv_cache_limit.logic.budget_ledger import Companions
    companions = Companions()
    held = companions.hold(sys.argv[1], sys.argv[2], sys.argv[3], rank=0)
    pid = os.fork()
    if pid == 0:  # a child of the worker (a compile worker): outlives it, 60 s at most
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(devnull, fd)
        time.sleep(60)
        os._exit(0)
    print(held, pid, flush=True)
    sys.stdin.readline()
    os._exit(0)
    """
)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def end(proc: subprocess.Popen[str]) -> None:
    """Let ``proc`` exit (a line on its stdin) and reap it."""
    assert proc.stdin is not None
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    proc.wait(timeout=30)


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str], int, str]]:
    """An engine core in the ledger of ``tmp_path`` and a worker holding a
    companion of its entry, the worker's forked child sleeping: yields the
    two, the child's pid and the entry's name."""
    procs: list[subprocess.Popen[str]] = []
    child = -1
    try:
        procs.append(spawn(ENGINE_CORE, str(tmp_path), KEY, json.dumps(RECORD)))
        assert procs[0].stdout is not None
        name = procs[0].stdout.readline().strip()
        assert name.endswith(ENTRY_SUFFIX), name
        procs.append(spawn(WORKER, str(tmp_path), KEY, name))
        assert procs[1].stdout is not None
        held, pid = procs[1].stdout.readline().split()
        child = int(pid)
        assert held == "True"
        yield procs[0], procs[1], child, name
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_dead_engine_cores_entry_is_counted_until_its_workers_exit(
    tmp_path: Path, instance: tuple[subprocess.Popen[str], subprocess.Popen[str], int, str]
) -> None:
    engine_core, worker, child, name = instance
    folder = tmp_path / folder_name(KEY)
    companion = f"{name}{COMPANION_INFIX}0"
    assert (folder / companion).is_file()
    reader = Ledger(str(tmp_path), KEY, label="reader")
    try:
        assert others(reader) == [{**RECORD, "label": "owner"}]
        end(engine_core)
        # The engine core is gone; its worker, and with it the memory it holds, is not.
        assert others(reader) == [{**RECORD, "label": "owner"}], "dropped while its worker lives"
        assert (folder / name).is_file() and (folder / companion).is_file()
        end(worker)
        assert alive(child), "the premise: the worker's forked child outlives it"
        # The worker's child closed its copy of the companion: the entry goes with the worker.
        assert others(reader) == [], "counted after its engine core and its worker exited"
        left = sorted(p.name for p in folder.iterdir() if p.name != "ledger.lock")
        assert left == [reader.entry_name], left
    finally:
        reader.close()


def test_companions_count_only_beside_their_instances_entry(tmp_path: Path) -> None:
    """A companion whose entry is gone is removed once unlocked, and counts
    nothing while locked; one another user planted beside a dead entry does
    not keep it counted; a worker holds each companion once, and one whose
    entry is not in that folder (a worker on another host) not at all."""
    owner = Ledger(str(tmp_path), KEY, label="owner")
    with owner.transaction() as view:
        view.write(RECORD)
    folder = tmp_path / folder_name(KEY)
    name = owner.entry_name
    companions = Companions()
    try:
        assert companions.hold(str(tmp_path), KEY, name, rank=1)
        assert companions.hold(str(tmp_path), KEY, name, rank=1)  # held already
        assert not companions.hold(str(tmp_path), KEY, "0123456789abcdef" + ENTRY_SUFFIX, rank=1)
        assert not companions.hold(str(tmp_path), KEY, "../x" + ENTRY_SUFFIX, rank=1)
        assert sorted(p.name for p in folder.iterdir()) == sorted(["ledger.lock", name, f"{name}{COMPANION_INFIX}1"])
        reader = Ledger(str(tmp_path), KEY, label="reader")
        try:
            # The entry is removed under its companion (its owner leaves with its workers alive).
            owner.close()
            assert others(reader) == []
            assert (folder / f"{name}{COMPANION_INFIX}1").is_file()  # locked: left
            companions.close()
            assert others(reader) == []
            assert sorted(p.name for p in folder.iterdir()) == sorted(["ledger.lock", reader.entry_name])
            if os.geteuid() == 0:  # a companion of another user's beside a dead entry
                dead = folder / f"fedcba9876543210{ENTRY_SUFFIX}"
                dead.write_text('{"budget": 1000, "floor": 7, "holds": 5, "wants": 0}')
                planted = folder / f"{dead.name}{COMPANION_INFIX}0"
                planted.write_text("")
                os.chown(planted, 65534, 65534)
                holder = subprocess.Popen(["flock", "-x", str(planted), "sleep", "30"])
                try:
                    for _ in range(100):  # bounded: until the holder has the lock
                        probe = subprocess.run(["flock", "-n", "-s", str(planted), "true"])
                        if probe.returncode != 0:
                            break
                        subprocess.run(["sleep", "0.05"])
                    assert others(reader) == [], "a planted companion kept a dead entry counted"
                    assert not dead.exists()
                finally:
                    holder.kill()
                    holder.wait(timeout=30)
        finally:
            reader.close()
    finally:
        companions.close()
        owner.close()
