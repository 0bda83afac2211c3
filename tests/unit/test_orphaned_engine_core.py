"""An engine core whose client process died (an API server SIGKILLed alone)
shuts itself down, so that its share of the shared budget goes back: vLLM
leaves such an engine core running, with its KV cache and its ledger entry,
and no client can reach it (found by the fault soak, benchmarks/soak.py,
RESULTS.md 13). Real processes: the client, and the engine core's process
running the autoscaler's wake-up thread (``wakeups.start_waking``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ENGINE_CORE = textwrap.dedent(
    """
    import queue, signal, sys, threading, time
    from types import SimpleNamespace
    from vllm_kv_cache_limit.hooks.runtime import wakeups

    marker = sys.argv[1]

    def on_term(signum, frame):  # vLLM's engine core shuts down on SIGTERM
        open(marker, "w").write("SIGTERM")
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    core = SimpleNamespace(input_queue=queue.Queue())
    scaler = SimpleNamespace(stop=threading.Event(), budget=8 << 20)
    wakeups.start_waking(core, scaler, "WAKEUP")
    open(marker + ".ready", "w").write("ready")
    time.sleep(60)
    """
)
CLIENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def _wait(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return path.exists()


def test_an_engine_core_whose_client_died_shuts_down(tmp_path: Path) -> None:
    marker = tmp_path / "engine-core"
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, ENGINE_CORE, str(marker)], stdout=subprocess.PIPE, text=True
    )
    assert client.stdout is not None
    core_pid = int(client.stdout.readline())
    try:
        assert _wait(Path(f"{marker}.ready"), 120), "the engine core's process did not start its wake-ups"
        assert not marker.exists()  # premise: its client lives, so it runs on
        os.kill(client.pid, signal.SIGKILL)
        client.wait()
        assert _wait(marker, 10), "the engine core ran on for 10 s after its client died"
        assert marker.read_text() == "SIGTERM"
    finally:
        for pid in (client.pid, core_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


WITH_A_WORKER = textwrap.dedent(
    """
    worker = multiprocessing.get_context("fork").Process(target=work, daemon=True)
    worker.start()
    signal.signal(signal.SIGTERM, on_term)
    scaler = SimpleNamespace(stop=threading.Event(), budget=8 << 20, orphaned=False, close=lambda: None)
    state = SimpleNamespace(announcement=None, autoscaler=scaler, lock=None)
    core = SimpleNamespace(input_queue=queue.Queue(), _kvcl_state=state)
    wakeups.start_waking(core, scaler, "WAKEUP")
    open(marker + ".ready", "w").write(str(worker.pid))
    """
)
"""An engine core's process with one worker and the autoscaler's wake-up
thread (after a script's ``work`` and ``on_term``)."""

ENGINE_CORE_WITH_WORKER = (
    textwrap.dedent(
        """
    import multiprocessing, os, queue, signal, sys, threading, time
    from types import SimpleNamespace
    from vllm_kv_cache_limit.hooks.runtime import engine_core, wakeups

    marker = sys.argv[1]

    def work():  # a worker busy in a kernel: it takes no signal but SIGKILL
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)

    def vllm_shutdown(self):  # vLLM's executor: waits for its workers, 5 s, SIGTERM, 5 s, then SIGKILL
        worker.join(5)
        worker.terminate()
        worker.join(5)
        worker.kill()

    def on_term(signum, frame):  # vLLM's engine core ends its busy loop, then calls its (wrapped) shutdown
        open(marker, "w").write("SIGTERM")
        engine_core._leave_budget_first(vllm_shutdown)(core)
        sys.exit(0)

    """
    )
    + WITH_A_WORKER
    + "time.sleep(60)\n"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def _engine_core_with_worker(tmp_path: Path, script: str) -> Iterator[tuple[Path, int, int, subprocess.Popen]]:
    """Run ``script`` as an engine core's process under a client process;
    once it is ready, yield its marker file, its pid, its worker's pid and
    the client; kill all three at the end."""
    marker = tmp_path / "engine-core"
    client = subprocess.Popen([sys.executable, "-c", CLIENT, script, str(marker)], stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    core_pid = int(client.stdout.readline())
    worker_pid = None
    try:
        assert _wait(Path(f"{marker}.ready"), 120), "the engine core's process did not start its wake-ups"
        worker_pid = int(Path(f"{marker}.ready").read_text())
        yield marker, core_pid, worker_pid, client
    finally:
        for pid in (client.pid, core_pid, worker_pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _kill(client: subprocess.Popen, alive: Callable[[], bool], bound_s: float) -> float:
    """SIGKILL ``client``; the seconds until ``alive()`` turned false (``bound_s`` at most)."""
    os.kill(client.pid, signal.SIGKILL)
    client.wait()
    died = time.monotonic()
    while alive() and time.monotonic() - died < bound_s:
        time.sleep(0.05)
    return time.monotonic() - died


def test_an_orphaned_engine_core_ends_its_workers_at_once(tmp_path: Path) -> None:
    """Its workers hold the memory its ledger entry counts, and the entry goes
    only once they are gone: vLLM's shutdown would give a busy worker 10 s
    (seen in the soak: the entry counted 10 s after the API server died)."""
    with _engine_core_with_worker(tmp_path, ENGINE_CORE_WITH_WORKER) as (marker, _, worker_pid, client):
        assert _alive(worker_pid) and not marker.exists()  # premise: its client lives, so it runs on
        lived = _kill(client, lambda: _alive(worker_pid), 15)
        assert not _alive(worker_pid), "the orphaned engine core's worker outlived it by 15 s"
        assert lived < 3, f"its worker lived {lived:.1f} s after the client died"
        assert _wait(marker, 5) and marker.read_text() == "SIGTERM"  # then vLLM's own shutdown


ENGINE_CORE_IN_A_LONG_STEP = (
    textwrap.dedent(
        """
    import multiprocessing, queue, signal, sys, threading, time
    from types import SimpleNamespace
    from vllm_kv_cache_limit.hooks.runtime import engine_core, wakeups

    marker = sys.argv[1]
    requested = threading.Event()

    def work():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)

    def on_term(signum, frame):  # vLLM's handler only asks: the busy loop shuts down after its step
        requested.set()

    """
    )
    + WITH_A_WORKER
    + textwrap.dedent(
        """
    while True:
        time.sleep(40)  # one step that waits on a worker for 40 s (a loaded machine)
        if requested.is_set():
            open(marker, "w").write("shutdown")
            engine_core._leave_budget_first(lambda self: worker.kill())(core)
            sys.exit(0)
    """
    )
)


def test_an_orphaned_engine_core_in_a_long_step_ends_with_its_workers_within_a_bound(tmp_path: Path) -> None:
    """vLLM's engine core shuts down only once its step in progress ends;
    on a loaded machine one took 19 s (the 2-hour soak), and its ledger entry
    counted all that time."""
    from vllm_kv_cache_limit.hooks.runtime import wakeups

    with _engine_core_with_worker(tmp_path, ENGINE_CORE_IN_A_LONG_STEP) as (marker, core_pid, worker_pid, client):
        assert _alive(core_pid) and _alive(worker_pid)  # premise: its client lives, so it runs on
        lived = _kill(client, lambda: _alive(core_pid) or _alive(worker_pid), 30)
        assert not _alive(worker_pid), "the orphaned engine core's worker lived 30 s on"
        assert not _alive(core_pid), "the orphaned engine core lived 30 s on, in its step"
        assert lived < wakeups.ORPHAN_GRACE_S + 3, f"it and its worker lived {lived:.1f} s after the client died"
        assert not marker.exists()  # ended before its step did: vLLM's shutdown never ran


ENGINE_CORE_WHOSE_EXECUTOR_MISSES_THE_EXIT = (
    textwrap.dedent(
        """
    import multiprocessing, os, queue, signal, sys, threading, time
    from types import SimpleNamespace
    from vllm_kv_cache_limit.hooks.runtime import engine_core, wakeups

    marker = sys.argv[1]

    def work():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)

    def executor_shutdown(self):  # vLLM's: is_alive() polled 5 s, SIGTERM, 4 s, then SIGKILL
        for grace in (5, 4):
            deadline = time.monotonic() + grace
            while worker.is_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            worker.terminate()
        worker.kill()

    def on_term(signum, frame):
        engine_core._leave_budget_first(executor_shutdown)(core)
        open(marker, "w").write("shut down")
        sys.exit(0)

    def close():  # the autoscaler leaves the ledger: its entries stop counting the workers' memory
        open(marker + ".closed", "w").write(repr(time.time()))

    """
    )
    + WITH_A_WORKER
    + textwrap.dedent(
        """
    scaler.close = close
    # Another wait on the worker reaps it: multiprocessing's Popen.poll then
    # meets ECHILD and answers None for ever, so is_alive() stays True.
    threading.Thread(target=os.waitpid, args=(worker.pid, 0), daemon=True).start()
    time.sleep(60)
    """
    )
)


def test_an_orphaned_engine_cores_entries_go_once_its_workers_have_exited(tmp_path: Path) -> None:
    """Not once vLLM's shutdown has seen them go: in the 2-hour soak its
    executor still found a killed worker alive 9 s after its memory was
    gone (its grace periods, then SIGKILL), and the entry counted 10.5 s.
    Here the executor cannot see the exit at all; the entries must go as
    soon as the worker has exited (its sentinel, closed by its exit after
    its memory is freed), long before the executor's 9 s."""
    with _engine_core_with_worker(tmp_path, ENGINE_CORE_WHOSE_EXECUTOR_MISSES_THE_EXIT) as (
        marker,
        core_pid,
        worker_pid,
        client,
    ):
        closed = Path(f"{marker}.closed")
        assert _alive(worker_pid) and not closed.exists()  # premise: its client lives, so it runs on
        killed = time.time()
        _kill(client, lambda: _alive(worker_pid), 15)
        assert not _alive(worker_pid), "the orphaned engine core's worker outlived it by 15 s"
        assert _wait(marker, 30), "the engine core's shutdown did not end"  # premise: the executor waited its 9 s
        assert closed.exists(), "the autoscaler never left the ledger"
        took = float(closed.read_text()) - killed
        assert took < 4, f"its entries counted {took:.1f} s after the client died, the worker gone long before"
