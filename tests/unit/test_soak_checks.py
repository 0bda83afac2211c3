"""The fault soak's invariant checker and fault scheduler
(``benchmarks/_soak_checks.py``) on injected readings: each invariant's
violation is found, and a clean series passes. No engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
MIB = 1 << 20
BLOCK = 256 * 1024


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_soak_checks", BENCHMARKS / "_soak_checks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


checks = _load()


def status(limit: int, in_use: int = 0, others: list | None = None) -> dict:
    return {
        "kv_cache_limit_bytes": limit,
        "num_blocks_in_use": in_use,
        "bytes_per_block": BLOCK,
        "autoscale": {"others": others or []},
    }


def entry(pid: int, holds: int) -> dict:
    return {"label": f"host pid {pid}", "pid": pid, "holds": holds, "budget": 16 * MIB}


def reading(
    t: float,
    holds: dict[int, int],
    limits: dict[int, int],
    states: dict[int, str] | None = None,
    running: set[int] | None = None,
    **kw,
):
    """Instances a, b, c with engine cores 101, 102, 103; ``running``: the
    killed processes not exited yet (``Reading.running``)."""
    states = states or {}
    instances = {}
    for pid, name in ((101, "a"), (102, "b"), (103, "c")):
        state = states.get(pid, "up")
        instances[name] = checks.Instance(
            state, 16 * MIB, {pid, pid + 1000} if state != "down" else set(), status(limits.get(pid, 0), **kw)
        )
    ledger = [entry(pid, h) for pid, h in holds.items()]
    return checks.Reading(t, 16 * MIB, ledger, instances, None, running=running)


def clean_series(checker) -> None:
    for t in range(10):
        holds = {101: 4 * MIB + t * BLOCK, 102: 4 * MIB, 103: 4 * MIB}
        checker.sample(reading(float(t), holds, {p: h for p, h in holds.items()}))


def test_a_clean_series_passes() -> None:
    checker = checks.Checker(checks.Bounds())
    clean_series(checker)
    checker.request("a", 1.0, 3.0, None)
    checker.tracebacks(5.0, "a-1", 1)
    checker.finish(10.0)
    assert checker.violations == []
    assert checker.summary()["worst"]["ledger_over_budget_bytes"] == 12 * MIB + 9 * BLOCK - 16 * MIB


def test_ledger_over_budget_is_a_violation_unless_an_instance_starts() -> None:
    checker = checks.Checker(checks.Bounds())
    over = {101: 8 * MIB, 102: 8 * MIB, 103: BLOCK}
    checker.sample(reading(1.0, over, {}))
    assert [v["invariant"] for v in checker.violations] == ["a"]
    assert checker.violations[0]["held"] == 16 * MIB + BLOCK
    # The start-up reservation of c (its cap) may go over, by at most that cap.
    checker = checks.Checker(checks.Bounds())
    checker.sample(reading(1.0, {101: 8 * MIB, 102: 8 * MIB, 103: 16 * MIB}, {}, {103: "starting"}))
    assert checker.violations == []
    checker.sample(reading(2.0, {101: 8 * MIB, 102: 8 * MIB + BLOCK, 103: 16 * MIB}, {}, {103: "starting"}))
    assert [v["invariant"] for v in checker.violations] == ["a"]


def test_committed_beyond_the_hold_by_more_than_a_chunk() -> None:
    checker = checks.Checker(checks.Bounds())
    checker.sample(reading(1.0, {101: 4 * MIB}, {101: 4 * MIB + BLOCK}))  # one chunk over: allowed
    assert checker.violations == []
    checker.sample(reading(2.0, {101: 4 * MIB}, {101: 4 * MIB + 2 * BLOCK}))
    assert [(v["invariant"], v["instance"]) for v in checker.violations] == [("b", "a")]
    # Blocks in use above a draining limit are committed too.
    checker = checks.Checker(checks.Bounds())
    checker.sample(reading(1.0, {101: 4 * MIB, 102: MIB, 103: MIB}, {101: 2 * MIB}, in_use=24))
    assert {v["instance"] for v in checker.violations} == {"a", "b", "c"}  # 24 blocks = 6 MiB


def test_a_hold_that_fell_while_the_status_was_read_counts_at_its_old_value() -> None:
    checker = checks.Checker(checks.Bounds())
    fell = reading(1.0, {101: 2 * MIB}, {101: 4 * MIB})  # the status shows the limit before the fall
    fell.before = [entry(101, 4 * MIB)]
    checker.sample(fell)
    assert checker.violations == []
    grew = reading(2.0, {101: 2 * MIB}, {101: 4 * MIB})  # held 2 MiB before and after: 4 MiB is over
    grew.before = [entry(101, 2 * MIB)]
    checker.sample(grew)
    assert [v["invariant"] for v in checker.violations] == ["b"]


def test_a_hold_rewritten_while_the_status_was_read_leaves_b_undecided() -> None:
    # 12 -> 22 -> 20 blocks between the two ledger reads: the status shows
    # 22, a hold neither read saw. Undecided, counted, not a violation.
    checker = checks.Checker(checks.Bounds())
    moved = reading(1.0, {101: 20 * BLOCK}, {101: 22 * BLOCK})
    moved.ledger[0]["written_ns"] = 2
    moved.before = [{**entry(101, 12 * BLOCK), "written_ns": 1}]
    checker.sample(moved)
    assert checker.violations == []
    assert checker.summary()["undecided_b"] == 1
    # The same entry, not rewritten between the reads: the hold is known, 22 is over.
    still = reading(2.0, {101: 20 * BLOCK}, {101: 22 * BLOCK})
    still.ledger[0]["written_ns"] = 2
    still.before = [{**entry(101, 20 * BLOCK), "written_ns": 2}]
    checker.sample(still)
    assert [v["invariant"] for v in checker.violations] == ["b"]
    assert checker.summary()["undecided_b"] == 1


def test_requests_fail_or_wait_only_on_their_own_faults() -> None:
    checker = checks.Checker(checks.Bounds(request_s=30.0, grace_s=5.0))
    checker.excuse("a", 100.0)
    checker.back("a", 150.0)
    checker.request("a", 90.0, 101.0, "ConnectionError")  # a was killed meanwhile
    checker.request("a", 152.0, 190.0, None)  # within the grace after a came back
    assert checker.violations == []
    checker.request("b", 90.0, 101.0, "ConnectionError")  # b was not faulted
    checker.request("a", 160.0, 191.0, None)  # 31 s, after the grace
    assert [(v["invariant"], v["instance"]) for v in checker.violations] == [("c", "b"), ("c", "a")]
    assert checker.summary()["requests"] == {"sent": 4, "completed": 2, "failed": 1, "failed_excused": 1}


def test_a_killed_share_must_be_freed_within_the_bound() -> None:
    checker = checks.Checker(checks.Bounds(freed_s=10.0))
    checker.killed({101, 1101}, 0.0, "a")
    # Gone from the ledger, still in b's others at 5 s; gone at 6 s.
    b_sees_a = [{"label": "host pid 101", "holds": 4 * MIB}]
    checker.sample(reading(5.0, {102: 4 * MIB}, {}, {101: "down"}, others=b_sees_a))
    checker.sample(reading(6.0, {102: 4 * MIB}, {}, {101: "down"}))
    assert checker.violations == []
    assert checker.summary()["worst"]["freed_s"] == 6.0
    checker.killed({101}, 20.0, "a")
    checker.sample(reading(31.0, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}))  # an orphan still holds it
    assert [(v["invariant"], v["pid"]) for v in checker.violations] == [("d", 101)]


def test_a_killed_share_is_timed_from_its_processes_exit_and_counted_while_a_worker_runs() -> None:
    """(d) from the exit of the last killed process (a worker that takes
    12 s to exit keeps the entry rightly); (g) an entry gone while one of
    the instance's workers runs is a violation, the API server's own exit
    is not waited for by (g)."""
    checker = checks.Checker(checks.Bounds(freed_s=10.0))
    checker.killed({1100, 101, 1101}, 0.0, "a", workers={1101})  # API server, engine core, worker
    assert checker.awaited() == {1100, 101, 1101}
    for t in (1.0, 6.0, 12.0):  # the worker exits at 12.5 s: the entry rightly stays
        checker.sample(reading(t, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}, running={1101}))
    checker.sample(reading(13.0, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}, running=set()))
    checker.sample(reading(20.0, {102: 4 * MIB}, {}, {101: "down"}, running=set()))
    worst = checker.summary()["worst"]
    assert checker.violations == [] and (worst["freed_s"], worst["freed_after_kill_s"]) == (7.0, 20.0)
    assert checker.awaited() == set()
    # Gone while its worker runs: (g); an entry that stays 10 s after every exit: (d).
    checker.killed({1100, 101, 1101}, 30.0, "a", workers={1101})
    checker.sample(reading(31.0, {102: 4 * MIB}, {}, {101: "down"}, running={1100, 1101}))
    checker.killed({1100, 101, 1101}, 40.0, "a", workers={1101})
    checker.sample(reading(41.0, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}, running={1100}))
    checker.sample(reading(42.0, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}, running=set()))
    checker.sample(reading(52.5, {101: 4 * MIB, 102: 4 * MIB}, {}, {101: "down"}, running=set()))
    found = [(v["invariant"], v["t_s"]) for v in checker.violations]
    assert found == [("g", 31.0), ("d", 52.5)], checker.violations
    assert checker.violations[0]["running"] == [1101] and checker.violations[1]["after_exit_s"] == 10.5


def test_a_restart_must_join_within_the_bound() -> None:
    checker = checks.Checker(checks.Bounds(join_s=60.0))
    checker.restarting("a", 0.0)
    checker.sample(reading(30.0, {102: MIB}, {}, {101: "up"}))  # serves, but holds no entry yet
    checker.sample(reading(40.0, {101: MIB, 102: MIB}, {}))
    assert checker.violations == [] and checker.summary()["worst"]["join_s"] == 40.0
    checker.restarting("b", 50.0)
    checker.sample(reading(111.0, {101: MIB}, {}, {102: "starting"}))
    assert [(v["invariant"], v["instance"]) for v in checker.violations] == [("e", "b")]
    checker.restarting("c", 120.0)
    checker.finish(130.0)  # never joined before the end
    assert [v["instance"] for v in checker.violations] == ["b", "c"]


def test_a_second_traceback_in_an_episode_is_reported_once() -> None:
    checker = checks.Checker(checks.Bounds())
    checker.tracebacks(1.0, "a-1", 1)
    checker.tracebacks(2.0, "a-2", 1)
    assert checker.violations == []
    checker.tracebacks(3.0, "a-2", 2)
    checker.tracebacks(4.0, "a-2", 3)
    assert [(v["invariant"], v["episode"], v["tracebacks"]) for v in checker.violations] == [("f", "a-2", 2)]


def test_the_scheduler_replays_a_seed_and_keeps_its_bounds() -> None:
    first = checks.FaultScheduler(7, ["kill", "stop", "lock"], ["a", "b", "c"], 30.0, 60.0)
    again = checks.FaultScheduler(7, ["kill", "stop", "lock"], ["a", "b", "c"], 30.0, 60.0)
    faults = [first.next(100.0 * i) for i in range(200)]
    assert faults == [again.next(100.0 * i) for i in range(200)]
    assert all(30.0 <= f.at - 100.0 * i <= 60.0 for i, f in enumerate(faults))
    assert {f.kind for f in faults} == {"kill", "stop", "lock"} and {f.target for f in faults} == {"a", "b", "c"}
    assert all(20.0 <= f.hold_s <= 60.0 for f in faults if f.kind == "stop")
    assert all(5.0 <= f.hold_s <= 30.0 for f in faults if f.kind == "lock")
    assert all(f.hold_s == 0.0 for f in faults if f.kind == "kill")
    other = checks.FaultScheduler(8, ["kill", "stop", "lock"], ["a", "b", "c"], 30.0, 60.0)
    assert [other.next(100.0 * i) for i in range(200)] != faults


@pytest.mark.parametrize(
    ("kinds", "lo", "hi", "quoted"),
    [(["kill", "melt"], 1.0, 2.0, "'melt'"), ([], 1.0, 2.0, "at least one"), (["kill"], 5.0, 2.0, "5.0-2.0")],
)
def test_the_scheduler_refuses_bad_settings(kinds: list[str], lo: float, hi: float, quoted: str) -> None:
    with pytest.raises(ValueError, match=quoted):
        checks.FaultScheduler(1, kinds, ["a"], lo, hi)


def test_read_ledger_counts_live_valid_entries_and_waits_for_the_lock_with_a_bound(tmp_path: Path) -> None:
    import fcntl
    import json
    import os
    import time

    folder = tmp_path / "budget-cpu-node0"
    folder.mkdir()
    (folder / "ledger.lock").touch()
    records = {
        "live.entry": {"budget": 16 * MIB, "floor": MIB, "holds": 3 * MIB, "wants": 3 * MIB, "label": "h pid 42"},
        "dead.entry": {"budget": 16 * MIB, "floor": MIB, "holds": 5 * MIB, "wants": 5 * MIB, "label": "h pid 43"},
        "planted.entry": {"budget": 0, "floor": MIB, "holds": "lots", "wants": 0},
        "orphan.entry": {"budget": 16 * MIB, "floor": MIB, "holds": 7 * MIB, "wants": 0, "label": "h pid 44"},
    }
    held = []
    for name, record in records.items():
        (folder / name).write_text(json.dumps(record))
        # dead: its owner is gone, nobody holds its lock; orphan: its engine
        # core is gone, a worker holds a companion (budget_ledger.Companions).
        path = folder / (name if name not in ("dead.entry", "orphan.entry") else f"{name}.w0")
        if name != "dead.entry":
            path.touch()
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
    (folder / "dead.entry.w0").touch()  # its worker gone too
    try:
        entries, locked = checks.read_ledger(tmp_path)
        assert locked and [(e["holds"], e["pid"]) for e in entries] == [(3 * MIB, 42), (7 * MIB, 44)]
        assert entries[0]["written_ns"] == (folder / "live.entry").stat().st_mtime_ns
        lock = os.open(folder / "ledger.lock", os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held from outside
        held.append(lock)
        began = time.monotonic()
        entries, locked = checks.read_ledger(tmp_path, wait_s=0.2)
        assert not locked and [e["pid"] for e in entries] == [42, 44]
        assert time.monotonic() - began < 5
    finally:
        for fd in held:
            os.close(fd)


def test_a_soak_longer_than_its_trace_replays_the_trace_again() -> None:
    trace = [(10.0, 1, 1), (40.0, 2, 2), (59.0, 3, 3)]  # a trace of 60 s
    got = checks.looped(trace, start_s=30.0, length_s=100.0, period_s=60.0)
    # from 30 s: 40 and 59 of the first lap, then 10, 40, 59 of the second (the third's 10 s is at 100 s: the end)
    assert got == [(10.0, 2, 2), (29.0, 3, 3), (40.0, 1, 1), (70.0, 2, 2), (89.0, 3, 3)]
    assert checks.looped(trace, 0.0, 60.0, 60.0) == trace  # within one lap: the trace itself
    with pytest.raises(ValueError, match="positive"):
        checks.looped(trace, 0.0, 60.0, 0.0)


def test_watch_exits_records_what_a_killed_process_did_until_it_exited() -> None:
    """A child that sleeps, then a grandchild-free exit at its kill: the
    rows show it sleeping, then exited (a zombie until reaped, or gone),
    at or after the kill; one that outlives the bound has no exit row."""
    import signal
    import subprocess
    import threading

    killed = subprocess.Popen(["sleep", "60"])
    lives = subprocess.Popen(["sleep", "60"])
    try:
        seen: dict = {}
        watch = threading.Thread(target=lambda: seen.update(checks.watch_exits({killed.pid, lives.pid}, 1.5)))
        watch.start()
        killed.send_signal(signal.SIGKILL)  # not reaped until .wait(): a zombie meanwhile
        watch.join(timeout=30)
        assert not watch.is_alive()
        rows = seen[killed.pid]
        assert checks.exited(rows[-1][1]) and rows[-1][1].startswith("Z"), rows
        assert [state[0] for _, state in rows[:-1]] in ([], ["S"], ["R"], ["S", "R"], ["R", "S"]), rows
        assert not any(checks.exited(state) for _, state in seen[lives.pid]), seen[lives.pid]
        assert seen[lives.pid][-1][1].startswith("S"), seen[lives.pid]  # asleep in the kernel at the bound
        assert "; rss " in seen[lives.pid][-1][1] and "rss" not in rows[-1][1], (seen[lives.pid], rows)
        killed.wait(timeout=10)
        assert checks.proc_state(killed.pid) is None
    finally:
        lives.kill()
        lives.wait(timeout=10)
        killed.kill()
        killed.wait(timeout=10)


def test_a_soaks_processes_are_found_by_their_environment_and_waited_for_with_a_bound(tmp_path: Path) -> None:
    """``pids_with_env`` finds a process started with the soak's lock folder
    and nothing else; ``wait_gone`` returns what outlives its bound, then
    nothing once the group has exited."""
    import os
    import subprocess
    import time

    env = {**os.environ, "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(tmp_path)}
    ours = subprocess.Popen(["sleep", "60"], env=env, start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], env={**env, "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(tmp_path / "x")})
    try:
        assert checks.pids_with_env("VLLM_KV_CACHE_LIMIT_LOCK_DIR", str(tmp_path)) == {ours.pid}
        began = time.monotonic()
        assert checks.wait_gone(ours.pid, 0.5) == {ours.pid}
        assert 0.5 <= time.monotonic() - began < 5
        ours.kill()
        ours.wait(timeout=10)  # reaped: group_pids leaves zombies out anyway
        assert checks.wait_gone(ours.pid, 5) == set()
        assert checks.pids_with_env("VLLM_KV_CACHE_LIMIT_LOCK_DIR", str(tmp_path)) == set()
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait(timeout=10)


def test_a_process_whose_main_thread_exited_has_not_exited_while_a_thread_runs() -> None:
    """Its main thread is a zombie, yet it keeps its memory until its last
    thread exits: ``proc_state`` names the threads left, and ``exited``
    holds only once the last one has gone."""
    import subprocess
    import sys
    import time

    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,)).start()\n"
        "print('ready', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 10
        while not (checks.proc_state(proc.pid) or "").startswith("Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        state = checks.proc_state(proc.pid)
        assert state is not None and state.startswith("Z; 1 threads left: "), state  # its sleeping thread
        assert not checks.exited(state)
        assert (checks.resident(proc.pid) or 0) > 1 << 20  # read from its live thread
        proc.kill()
        proc.wait(timeout=10)
        assert checks.proc_state(proc.pid) is None and checks.exited("gone") and checks.exited("Z")
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_cpu_seconds_and_busy_shares_follow_a_spinning_process() -> None:
    """A process spinning on one CPU: ``cpu_seconds`` grows with what it
    has used (and a process gone adds nothing), and ``busy`` gives that
    CPU a busy share of at least a half over a stretch it spun through."""
    import os
    import subprocess
    import sys
    import time

    cpu = sorted(os.sched_getaffinity(0))[0]
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint('ready', flush=True)\nwhile True: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        first, before, began = checks.cpu_seconds({proc.pid}), checks.cpu_ticks(), time.monotonic()
        deadline = began + 60  # a bound: on a loaded machine the spinner gets a fraction of its CPU
        while checks.cpu_seconds({proc.pid}) < first + 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        used, shares = checks.cpu_seconds({proc.pid}) - first, checks.busy(before, checks.cpu_ticks())
        assert 0.3 <= used <= time.monotonic() - began + 0.05, used  # one thread: at most its wall time
        assert shares[cpu] is not None and 0.5 <= shares[cpu] <= 1.0, shares
        assert all(s is None or 0.0 <= s <= 1.0 for s in shares.values()), shares
        proc.kill()
        proc.wait(timeout=10)
        assert checks.cpu_seconds({proc.pid}) == 0.0
        now = checks.cpu_ticks()
        assert set(checks.busy(now, now).values()) == {None}  # no tick between the two
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_busiest_traces_go_to_different_cpus() -> None:
    """Two conversation traces and a lighter code trace on 2 CPUs: the two
    heavy ones apart, the light one beside the lighter of them; with a CPU
    each, each its own; with none, a clear error."""
    loads = {"a": 7871.0, "b": 3728.0, "c": 7876.0}
    placed = checks.place(loads, [0, 1])
    assert placed["a"] != placed["c"], placed
    assert placed["b"] == placed["a"], placed  # a's load is the lighter of the two
    assert sorted(checks.place(loads, [2, 5, 7]).values()) == [2, 5, 7]
    assert checks.place({"x": 1.0, "y": 1.0}, [3]) == {"x": 3, "y": 3}
    with pytest.raises(ValueError, match="no CPU"):
        checks.place(loads, [])


def test_the_workers_of_an_engine_core_are_its_children_less_the_resource_tracker() -> None:
    """A process that spawns a child with multiprocessing (which starts
    Python's resource tracker beside it, as vLLM's engine core does): its
    workers are that child alone."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    code = (
        "import multiprocessing as mp, sys, time\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn')\n"
        "    ctx.Semaphore(1)  # a named semaphore: the resource tracker starts\n"
        "    child = ctx.Process(target=time.sleep, args=(60,), daemon=True)\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = -1
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        children = {int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()}
        assert len(children) == 2 and child in children, children  # the premise: the tracker is a child too
        assert checks.workers_of(proc.pid) == {child}
        assert checks.workers_of(child) == set()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
