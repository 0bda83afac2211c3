"""What the tests and the benchmarks share to run vLLM engines (not part of
the package): the engine environment, a child process with one result line,
the workers' KV cache readings (``KVCacheProbe``, ``mincore``), OpenAI API
servers (``api_servers``), a steady completion load and metrics.

Run as a module it starts a vLLM engine, measures the KV cache its workers
allocated, and prints one JSON line, each engine in its own process so that
nothing outlives the measurement (from the repository's root):

    python -m tests.helpers '{"model": "models/tiny-llama", "kv_cache_max_memory": "16M"}'

The JSON object holds ``LLM(...)`` keyword arguments plus optional probe
settings: ``prompts`` (list of str) and ``max_tokens`` for a greedy
generation, and ``resize_to`` (a size) for a run-time resize after it. The
output line starts with ``PROBE_RESULT `` and holds ``kv_cache_bytes`` (per
worker, summed over the storages of the KV cache tensors),
``num_gpu_blocks``, ``block_size``, ``texts``, with ``resize_to`` the
``resize`` status or ``resize_error``, with it or autoscaling the limit's
``status`` at the end, and, on failure, ``error_type`` and ``error``.

Child processes find this module (``tests.helpers``, e.g. the worker
extension ``tests.helpers.KVCacheProbe``) when they start in the repository's
root with ``python -m`` (``run_child`` and ``api_servers`` take ``cwd``), or
below a process that has the root on ``sys.path`` (vLLM's workers, Ray's
workers take the driver's working directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.logic.kv_cache import kv_cache_storages, lazy_free_bytes_in, rss_bytes, worker_kv_cache_bytes

RESULT_PREFIX = "PROBE_RESULT "

ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
"""What an engine process of the tests and benchmarks needs: models read
offline, and ``LLM.collective_rpc`` with a plain function (the measurement)."""

BASE_ENGINE_ARGS: dict[str, Any] = {"enforce_eager": True, "seed": 0}
"""``LLM(...)`` arguments every test and benchmark engine shares: no graph
capture (a quick start) and seeded sampling."""

SHARED_UTILIZATION = {"cpu": 0.25, "cuda": 0.5}
"""Per device, a ``gpu_memory_utilization`` that lets an engine start beside
others on a shared machine."""


def engine_env(**extra: str) -> dict[str, str]:
    """The environment for an engine in a child process: this process's,
    with ``ENGINE_ENV``, without a cap from the environment (the caller
    sets the cap it means) or the plugin's internal variables, plus
    ``extra``."""
    from vllm_kv_cache_limit.logic import envs
    from vllm_kv_cache_limit.logic.cap_decision import ENV_VAR

    env = {**os.environ, **ENGINE_ENV}
    env.pop(ENV_VAR, None)
    # The plugin's internal variables belong to the process tree of one
    # engine; a test process that ran plugin code may still carry them.
    env.pop(envs.ERROR_FILE, None)
    env.pop(envs.INACTIVE_WARNED, None)
    env.update(extra)
    return env


def enter_engine_process() -> None:
    """Called first in a child that starts an engine: ``ENGINE_ENV`` for this
    process and its workers (an offline setting already made is kept)."""
    os.environ.setdefault("HF_HUB_OFFLINE", ENGINE_ENV["HF_HUB_OFFLINE"])
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = ENGINE_ENV["VLLM_ALLOW_INSECURE_SERIALIZATION"]


def error_result(exc: BaseException) -> dict[str, Any]:
    """An engine's failure as the result line reports it."""
    return {"error_type": type(exc).__name__, "error": str(exc), "error_mro": [c.__name__ for c in type(exc).__mro__]}


def logged_value_errors(log: str) -> list[str]:
    """The messages of the ``ValueError`` tracebacks in an engine's log, in
    order: where vLLM's own errors from the engine core or a worker end up
    (the first process reports only "Engine core initialization failed")."""
    return [line.split("ValueError: ", 1)[1] for line in log.splitlines() if "ValueError: " in line]


def print_result(result: dict[str, Any], prefix: str = RESULT_PREFIX) -> None:
    """Print the result line and exit: 0 when ``result["ok"]``, else 1."""
    print(prefix + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


@dataclass
class ChildRun:
    """A child process that printed one result line (see :func:`run_child`)."""

    result: dict[str, Any] | None
    """The last result line's object; None when it printed none."""
    log: str
    returncode: int


def run_child(
    command: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None, prefix: str = RESULT_PREFIX
) -> ChildRun:
    """Run ``command`` (an engine in its own process) to its end and read the
    last line of its stdout that starts with ``prefix``."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    result = json.loads(lines[-1][len(prefix) :]) if lines else None
    return ChildRun(result, proc.stdout + proc.stderr, proc.returncode)


def _cpu_storage_pages(worker: Any) -> list[tuple[int, int, list[bool]]] | None:
    """``(data_ptr, bytes, resident per page)`` for each storage of a
    worker's KV cache (``mincore``; CPU backend, Linux), or None where it
    cannot be read. Pages are counted from the one holding ``data_ptr``."""
    import ctypes
    import mmap

    found = kv_cache_storages(worker)
    if not found or {device for _, device in found.values()} != {"cpu"}:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    storages = []
    for ptr, (nbytes, _) in found.items():
        start = ptr - ptr % page
        length = ptr + nbytes - start
        vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            return None
        storages.append((ptr, nbytes, [bool(v & 1) for v in vec]))
    return storages


def kv_cache_resident_bytes(worker: Any) -> int | None:
    """How many bytes of a worker's KV cache storages are resident in RAM
    and held (``mincore`` over each, less the pages released lazily,
    ``LazyFree`` in ``/proc/self/smaps``; CPU backend, Linux), or None where
    it cannot be read: allocated bytes are not resident until written, pages
    given back with ``MADV_DONTNEED`` are not resident until written again,
    and pages given back with ``MADV_FREE`` stay resident but are the
    kernel's to take until written again."""
    import mmap

    storages = _cpu_storage_pages(worker)
    if storages is None:
        return None
    with open("/proc/self/smaps") as smaps:
        mappings = smaps.read()
    held = 0
    for ptr, nbytes, pages in storages:
        resident = min(nbytes, sum(pages) * mmap.PAGESIZE)
        held += max(0, resident - lazy_free_bytes_in(mappings, ptr, ptr + nbytes))
    return held


def kv_cache_fault_in(worker: Any) -> int | None:
    """Make every page of a worker's KV cache storages resident, for tests
    whose premise is a cache all in RAM (after a grow, released pages come
    back only as requests write their blocks). Each page that is not resident
    has its first byte in the storage read and written back, so no content
    changes; call it between steps (a ``collective_rpc`` is). Returns the
    bytes of the pages brought in, or None where residency cannot be read."""
    import ctypes
    import mmap

    storages = _cpu_storage_pages(worker)
    if storages is None:
        return None
    page = mmap.PAGESIZE
    brought = 0
    for ptr, _, pages in storages:
        start = ptr - ptr % page
        for index, resident in enumerate(pages):
            if not resident:
                byte = ctypes.c_char.from_address(max(ptr, start + index * page))
                byte.value = byte.value
                brought += page
    return brought


class KVCacheProbe:
    """Worker extension for servers under test
    (``--worker-extension-cls tests.helpers.KVCacheProbe``): with
    ``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc {"method":
    "kv_cache_bytes"}`` returns each worker's KV cache bytes."""

    def kv_cache_bytes(self) -> int:
        return worker_kv_cache_bytes(self)

    def kv_cache_resident_bytes(self) -> int | None:
        return kv_cache_resident_bytes(self)

    def kv_cache_fault_in(self) -> int | None:
        return kv_cache_fault_in(self)

    def kv_cache_limit_rss_fall(self) -> int:
        """How far this worker's RSS fell at its last release of KV cache
        pages (measured by the plugin around its ``madvise`` calls)."""
        state = WorkerState.peek(self)
        return 0 if state is None else state.rss_fall


def worker_rss_bytes(worker: Any) -> int:
    """Resident memory of the worker process."""
    return rss_bytes()


def engine_cache_settings(llm: Any) -> dict[str, Any]:
    """The KV cache settings an ``LLM`` ended up with, as its engine config
    holds them after start-up."""
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    return {
        "num_gpu_blocks": cache_config.num_gpu_blocks,
        "block_size": cache_config.block_size,
        "num_gpu_blocks_override": cache_config.num_gpu_blocks_override,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "kv_cache_max_memory": getattr(cache_config, "kv_cache_max_memory", None),
        "max_model_len": vllm_config.model_config.max_model_len,
    }


def run(spec: dict[str, Any], shut_down: bool = False) -> dict[str, Any]:
    """Start ``LLM(**spec)`` here, measure it, generate; the result object.
    ``shut_down``: stop the engine before returning (for a process that
    starts another one next, see :func:`serve_probes`)."""
    enter_engine_process()
    spec = dict(spec)
    prompts = spec.pop("prompts", ["Hello, my name is"])
    max_tokens = spec.pop("max_tokens", 8)
    resize_to = spec.pop("resize_to", None)
    result: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    llm = None
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**spec)
        result["startup_s"] = time.perf_counter() - started
        result["kv_cache_bytes"] = llm.collective_rpc(worker_kv_cache_bytes)
        result["worker_rss_bytes"] = llm.collective_rpc(worker_rss_bytes)
        result.update(engine_cache_settings(llm))
        if prompts:
            outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            result["texts"] = [o.outputs[0].text for o in outputs]
        if resize_to is not None or spec.get("kv_cache_autoscale"):
            from vllm_kv_cache_limit.hooks.runtime.client import kv_cache_limit_status, set_kv_cache_max_memory
            from vllm_kv_cache_limit.logic.errors import KVCacheResizeError

            if resize_to is not None:
                try:
                    result["resize"] = set_kv_cache_max_memory(llm, resize_to, timeout_s=60)
                except KVCacheResizeError as exc:
                    result["resize_error"] = error_result(exc)
            result["status"] = kv_cache_limit_status(llm)
        result["ok"] = True
    except Exception as exc:  # reported, not raised: the caller reads the line
        result.update(error_result(exc))
    if shut_down and llm is not None:
        llm.llm_engine.engine_core.shutdown()
        del llm
        import gc

        gc.collect()
    return result


PROBE_CHILDREN_GONE_S = 60.0
"""How long the engine processes of one probe may take to exit before
:func:`serve_probes` starts the next one."""


def _engine_children() -> list[Any]:
    """This process's live descendants, less Python's multiprocessing
    resource tracker (started by the first spawn, it lives as long as this
    process by design)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def serve_probes() -> None:
    """Run probes one after the other in this process (``python -m
    tests.helpers --serve``), so that a module's probes with the same
    environment import torch and vLLM once instead of once each. Each line
    of standard input is ``{"spec": ..., "log": PATH}``: the probe's output,
    this process's and that of the engine processes it spawns, goes to
    ``PATH``; its result line to this process's standard output. Before each
    probe the environment is set back to the one this process started with,
    and the previous probe's engine processes are gone (killed past
    ``PROBE_CHILDREN_GONE_S``), as if each ran in a fresh process."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    environ = dict(os.environ)
    for line in sys.stdin:
        request = json.loads(line)
        os.environ.clear()
        os.environ.update(environ)
        sys.stdout.flush()
        sys.stderr.flush()
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        result = run(request["spec"], shut_down=True)
        deadline = time.monotonic() + PROBE_CHILDREN_GONE_S
        while (left := _engine_children()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for child in left:
            print(f"probe driver: killing {child.pid}, still alive {PROBE_CHILDREN_GONE_S} s after its engine stopped")
            with contextlib.suppress(Exception):
                child.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        results.write(RESULT_PREFIX + json.dumps(result) + "\n")


class ProbeDriver:
    """One ``python -m tests.helpers --serve`` process (see
    :func:`serve_probes`) with a fixed environment and interpreter: probes
    sent to it run one after the other, each with its own log."""

    def __init__(self, env: dict[str, str], python: str | None = None, cwd: Path | None = None) -> None:
        import queue
        import threading

        self.proc = subprocess.Popen(
            [python or sys.executable, "-m", "tests.helpers", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        """What the driver printed outside any probe's log (start-up errors)."""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, spec: dict[str, Any], log_path: Path, timeout: float) -> ChildRun:
        """Run one probe; its result (None when the driver died or ran past
        ``timeout``, which then ends it) and its log."""
        import queue

        assert self.proc.stdin is not None
        log_path.write_text("")
        result = None
        try:
            self.proc.stdin.write(json.dumps({"spec": spec, "log": str(log_path)}) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while result is None:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:
                    break
                if line.startswith(RESULT_PREFIX):
                    result = json.loads(line[len(RESULT_PREFIX) :])
                else:
                    self.output.append(line)
        except (queue.Empty, BrokenPipeError):
            pass
        if result is None:
            self.close()
        log = log_path.read_text()
        if result is None and self.output:
            log += "\nprobe driver output:\n" + "".join(self.output)
        return ChildRun(result, log, 0 if result is not None else (self.proc.returncode or -1))

    def close(self) -> None:
        """End the driver (and anything left of its engines)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """One OpenAI API server started by :func:`api_servers`."""

    base: str
    log_path: Path
    ready_s: float | None = None
    """Seconds from the common launch until /health answered; None if it never did."""
    returncode: int | None = None
    """Exit status when it exited before it was ready."""
    pid: int | None = None
    """The server's process id (its engine cores and workers are below it)."""


@contextlib.contextmanager
def api_servers(
    servers: dict[str, tuple[list[str], dict[str, str]] | tuple[list[str], dict[str, str], list[str]]],
    folder: Path,
    timeout: float = 300.0,
    cwd: Path | None = None,
) -> Iterator[dict[str, Server]]:
    """Start one OpenAI API server per name (its CLI arguments after
    ``--host/--port``, its environment, and optionally a command it runs
    under, such as ``unshare ...``) at the same instant, wait until each
    answers /health or exits, yield them, then stop them all, process
    groups included. Python's ``requests`` is needed."""
    import requests

    procs: dict[str, tuple[subprocess.Popen, Server]] = {}
    try:
        launched = time.monotonic()
        for name, (args, env, *launcher) in servers.items():
            port = free_port()
            log_path = folder / f"{name}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    [
                        *(launcher[0] if launcher else []),
                        sys.executable,
                        "-m",
                        "vllm.entrypoints.openai.api_server",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        *args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            procs[name] = (proc, Server(f"http://127.0.0.1:{port}", log_path, pid=proc.pid))
        pending = set(procs)
        while pending and time.monotonic() < launched + timeout:
            for name in sorted(pending):
                proc, server = procs[name]
                if proc.poll() is not None:
                    server.returncode = proc.returncode
                    pending.discard(name)
                    continue
                try:
                    if requests.get(f"{server.base}/health", timeout=2).status_code == 200:
                        server.ready_s = time.monotonic() - launched
                        pending.discard(name)
                except requests.RequestException:  # not listening yet, or too busy to answer in time
                    pass
            time.sleep(0.5)
        yield {name: server for name, (_, server) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class CompletionLoad:
    """``clients`` threads sending greedy completions of exactly
    ``max_tokens`` tokens back to back to the OpenAI server at ``base``
    (``with CompletionLoad(...) as load:``). Every reply is recorded, so a
    failed request cannot go unseen: ``done`` holds the monotonic time each
    request finished, ``failures`` what went wrong. Each prompt starts with
    its own number, so the prefix cache shares no block between requests.
    Python's ``requests`` is needed."""

    def __init__(
        self, base: str, clients: int, prompt: str, max_tokens: int, headers: dict[str, str] | None = None
    ) -> None:
        import threading

        self.base, self.prompt, self.max_tokens, self.headers = base, prompt, max_tokens, headers or {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent = 0
        self.done: list[float] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    @property
    def completed(self) -> int:
        return len(self.done)

    def _client(self) -> None:
        import requests

        while not self.stop.is_set():
            with self.lock:
                self.sent += 1
                prompt = f"{self.sent} {self.prompt}"
            body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
            try:
                reply = requests.post(
                    f"{self.base}/v1/completions", json={**body, "ignore_eos": True}, headers=self.headers, timeout=600
                )
                ok = reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == self.max_tokens
                problem = None if ok else f"{reply.status_code}: {reply.text[:300]}"
            except Exception as exc:
                problem = repr(exc)
            with self.lock:
                if problem:
                    self.failures.append(problem)
                else:
                    self.done.append(time.monotonic())

    def __enter__(self) -> CompletionLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)


class Periodic:
    """Calls ``sample()`` every ``period`` seconds in a daemon thread while
    entered (``with``); an exception is recorded in ``errors`` (a busy server
    that answered late) and the next call tries again."""

    def __init__(self, period: float) -> None:
        import threading

        self.period = period
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample()
            except Exception as exc:
                self.errors.append(repr(exc))
            self.stop.wait(self.period)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)


def ledger_holds(locks: Path) -> list[int]:
    """The holds in every budget ledger of the lock folder ``locks``, read as
    an outside reader, without the ledger's lock: a record is rewritten whole,
    and one caught mid-write is left out."""
    return _entry_holds(locks, "budget-*/*.entry")


def _entry_holds(folder: Path, pattern: str) -> list[int]:
    """The ``holds`` of the ledger entries matching ``pattern`` under
    ``folder``, in name order; an entry gone or caught mid-write is left out."""
    holds = []
    for entry in sorted(folder.glob(pattern)):
        with contextlib.suppress(OSError, ValueError, KeyError):
            holds.append(int(json.loads(entry.read_text())["holds"]))
    return holds


def live_ledger_entries(locks: Path, ledgers: str = "budget-*") -> int:
    """Ledger entries whose lock a live process holds, read as an outside
    reader would: an entry it can lock has no live owner. ``ledgers``: the
    ledger folders counted (a pattern; by default every device's)."""
    return sum(locked(entry) for entry in locks.glob(f"{ledgers}/*.entry"))


def locked(path: Path) -> bool:
    """Whether a live process holds the lock of ``path`` (False once it is gone)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def locked_ledger_holds(locks: Path) -> list[list[int]]:
    """Per budget ledger of ``locks``, the holds of its entries read under
    the ledger's own lock, as the instances read it: one consistent
    snapshot per ledger, which no grow or give-back is halfway through."""
    import fcntl

    snapshots = []
    for folder in sorted(locks.glob("budget-*")):
        fd = os.open(folder / "ledger.lock", os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            snapshots.append(_entry_holds(folder, "*.entry"))
        finally:
            os.close(fd)  # drops the lock
    return snapshots


def metric(base: str, name: str) -> float:
    """The sum of metric ``name`` over its label sets on ``base``/metrics."""
    import re

    import requests

    text = requests.get(base + "/metrics", timeout=60).text
    values = [float(m[1]) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    if not values:
        raise KeyError(f"{name} not in {base}/metrics")
    return sum(values)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve_probes()
    else:
        print_result(run(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
