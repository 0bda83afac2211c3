"""What makes an idle engine core's autoscaler decide: vLLM's own
``WAKEUP`` in its input queue, or, for an engine core in the caller's
process (no input queue), a timer that decides between the caller's calls.
Every decision runs where the engine core's steps run, never beside one."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.logger import init_logger

from vllm_kv_cache_limit.hooks.runtime.autoscaler import TICK_S, Autoscaler, _end_failing
from vllm_kv_cache_limit.logic.autoscale_policy import Episode

# Under the "vllm" logger so that vLLM's logging configuration applies.
logger = init_logger("vllm.plugins.kv_cache_limit")


def start_waking(engine_core: Any, scaler: Autoscaler, wakeup: Any) -> threading.Thread:
    """A daemon thread that puts vLLM's own ``WAKEUP`` into an idle engine
    core's input queue every ``TICK_S``, so that the autoscaler also decides
    while no request arrives (an idle engine core blocks on that queue).
    It only enqueues: every decision runs in the engine core's thread.

    With a shared budget it also shuts the engine core down (``SIGTERM``,
    vLLM's own shutdown) once the process that started it is gone: vLLM
    leaves an engine core whose API server died alone running, with its KV
    cache and its ledger entry, and no client can reach it, so its share
    would never go back to the other instances. The shutdown kills its
    workers before vLLM's (``end_children``, from ``EngineCore.shutdown``'s
    wrapper): killed while a step runs, they would fail the step. vLLM's
    busy loop shuts down only after its step in progress, which on a loaded
    machine took 19 s: a shutdown that has not begun within
    ``ORPHAN_GRACE_S`` is not waited for, and the workers, then the engine
    core, are killed (``end_orphan``)."""
    parent = os.getppid()

    def run() -> None:
        while not scaler.stop.wait(TICK_S):
            if scaler.budget is not None and os.getppid() != parent:
                scaler.orphaned = True
                logger.error(
                    "KV cache autoscale: the process that started this engine core (pid %d) is gone; shutting the "
                    "engine core down, its workers ended first, so that its share of the shared budget goes back "
                    "to the other instances.",
                    parent,
                )
                os.kill(os.getpid(), signal.SIGTERM)
                if not scaler.stop.wait(ORPHAN_GRACE_S):  # set by the shutdown's wrapper once it begins
                    end_orphan()
                return
            queue = getattr(engine_core, "input_queue", None)
            if queue is not None and queue.empty():
                queue.put_nowait((wakeup, None))

    thread = threading.Thread(target=run, name="kv-cache-autoscale", daemon=True)
    thread.start()
    return thread


ORPHAN_GRACE_S = 3.0
"""Seconds an orphaned engine core's own shutdown has to begin (its step
in progress to end) before the engine core and its workers are killed."""


WORKERS_EXIT_S = 5.0
"""Seconds an orphaned engine core waits for the workers it killed to exit
before its ledger entries go (with them, or at its own exit after)."""


def end_orphan() -> None:
    """End this orphaned engine core at once: its workers, then itself
    (SIGKILL, no step or shutdown waited for). Nobody can read its outputs;
    its ledger entries go with the process (a lock the kernel drops), once
    the workers whose memory they count have exited (``WORKERS_EXIT_S`` at
    most)."""
    children = end_children()
    logger.error(
        "KV cache autoscale: this orphaned engine core did not begin its shutdown within %g s (a step in "
        "progress); ending its workers (pids %s) and itself now.",
        ORPHAN_GRACE_S,
        ", ".join(str(child.pid) for child in children) or "none",
    )
    wait_exited(children, WORKERS_EXIT_S)
    os.kill(os.getpid(), signal.SIGKILL)


def end_children() -> list[Any]:
    """SIGKILL this process's multiprocessing children (an engine core's:
    vLLM's workers) and return them. An orphaned engine core's workers
    serve nobody, and they hold the memory its ledger entry counts until they
    exit: vLLM's shutdown would give a busy worker up to 10 s (its grace
    periods) before killing it, while the entry keeps their share."""
    import multiprocessing

    ended = []
    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError, ValueError):  # gone already, or closed
            child.kill()
            ended.append(child)
    return ended


def wait_exited(children: list[Any], seconds: float) -> bool:
    """Whether all ``children`` (multiprocessing processes) have exited
    within ``seconds``, by their sentinels: the pipe a child's exit closes
    once all its threads are done with its memory. Not ``is_alive()``:
    under load vLLM's executor found a killed worker alive 9 s after its
    memory was gone (``waitpid``, which another wait may have answered)."""
    from multiprocessing.connection import wait

    pending = set()
    for child in children:
        with contextlib.suppress(ValueError):  # closed: nothing to wait for
            pending.add(child.sentinel)
    deadline = time.monotonic() + seconds
    while pending and (left := deadline - time.monotonic()) > 0:
        pending.difference_update(wait(list(pending), timeout=left))
    return not pending


def start_deciding(scaler: Autoscaler, lock: threading.RLock, decide: Callable[[], None]) -> threading.Thread:
    """A daemon thread that runs ``decide`` every ``TICK_S`` while it can
    take ``lock`` at once, for an engine core in the caller's process
    (vLLM's in-process client): it has no input queue to wake, and while
    the caller makes no call it takes no step. A call in progress holds the
    lock, and its steps decide; a decision in progress makes the next call
    wait for it."""

    failing = Episode()  # this thread's own: a step's decision keeps the scaler's

    def run() -> None:
        while not scaler.stop.wait(TICK_S):
            if not lock.acquire(blocking=False):
                continue
            try:
                if not scaler.stop.is_set():
                    decide()
            except Exception:  # the thread goes on; the next decision may work
                if failing.begin(time.monotonic()):
                    logger.exception(
                        "KV cache autoscaling failed while the engine idled (logged once until a decision works again)."
                    )
            else:
                _end_failing(failing, time.monotonic())
            finally:
                lock.release()
        if scaler.close_when_stopped:  # a shutdown went on without waiting for the last decision
            scaler.close()

    thread = threading.Thread(target=run, name="kv-cache-autoscale", daemon=True)
    scaler.timer = thread
    thread.start()
    return thread
