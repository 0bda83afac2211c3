"""Fixtures for the end-to-end tests: real vLLM engines on the CPU with the
tiny model, each started in its own process by ``tests.helpers``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import helpers
from tests.conftest import ALONE_MODULES, REPO, TEST_MAX_MODEL_LEN, UPSTREAM

ENGINE_TIMEOUT_S = 300

# Small CPU budget so engines fit beside each other on a 2-core test machine.
BASE_ENGINE_ARGS: dict[str, Any] = {
    **helpers.BASE_ENGINE_ARGS,
    "max_model_len": TEST_MAX_MODEL_LEN,
    "gpu_memory_utilization": helpers.SHARED_UTILIZATION["cpu"],
}

engine_env = helpers.engine_env

FIXTURES = Path(__file__).parent / "fixtures"
"""Test-only vLLM plugins, each a folder with a ``.dist-info`` naming its
entry point; never installed, found through ``PYTHONPATH``."""


CPU_SHM = Path("/dev/shm")
CPU_SHM_PATTERN = "*-cpushm_*"
"""vLLM's CPU backend gives each tensor- or pipeline-parallel group a shared
memory segment named after the group's distributed port
(``VLLM_DIST_IDENT``), and does not unlink it when its workers are killed
(Ray shutting down, a failed start-up). A later engine that draws the same
port then fails: "create shm in SHMManager failed. errno: 17"."""


def _in_use(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` that a live process has open or mapped."""
    wanted = {str(path) for path in paths}
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                name = line.split(maxsplit=5)[-1]
                if name in wanted:
                    found.add(name)
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target in wanted:
                        found.add(target)
    return {Path(name) for name in found}


@pytest.fixture(autouse=True)
def _remove_leaked_cpu_shm() -> Iterator[None]:
    """Removes the CPU backend's shared-memory segments that appeared during
    a test and that no live process has open or mapped (left by engines that
    were killed), so that no later engine collides with one. Segments of
    running engines stay, also those of another test running at the same
    time (``make test`` runs two at once)."""
    before = set(CPU_SHM.glob(CPU_SHM_PATTERN))
    yield
    appeared = set(CPU_SHM.glob(CPU_SHM_PATTERN)) - before
    for path in appeared - _in_use(appeared):
        path.unlink(missing_ok=True)


MODULE_LOCK = Path(tempfile.gettempdir()) / f"vllm-kv-cache-limit-tests-{os.getuid()}.lock"
"""``make test`` runs two test files at once (pytest-xdist). A module of
``ALONE_MODULES`` holds this file's lock exclusively while it runs, the
others shared: its premises on the memory node's free memory (ballast,
vLLM's gate, fit checks) are then not moved by another module's engines.
The kernel drops the lock with the process."""


MODULE_LOCK_WAIT_S = 1800
"""The longest a module waits for the other worker's modules (an alone
module waits for the module running beside it; the others for the alone
modules, about 15 minutes here)."""


@pytest.fixture(scope="module", autouse=True)
def _module_lock(request: pytest.FixtureRequest) -> Iterator[None]:
    """Set up before the module's other fixtures (autouse), so that its
    servers start inside the lock."""
    import fcntl

    alone = Path(str(request.node.fspath)).relative_to(REPO / "tests").as_posix() in ALONE_MODULES
    fd = os.open(MODULE_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + MODULE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if alone else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the other test worker held {MODULE_LOCK} for over {MODULE_LOCK_WAIT_S} s")
                time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def with_plugins(*folders: Path | str) -> str:
    """``PYTHONPATH`` with ``folders`` (test-only plugins) before this
    process's own, for an engine in a child process."""
    return os.pathsep.join(filter(None, [*map(str, folders), os.environ.get("PYTHONPATH")]))


def run_probe(
    spec: dict[str, Any], env: dict[str, str] | None = None, python: str | None = None
) -> tuple[dict[str, Any], str]:
    """Run one engine in a fresh process (of ``python``, by default this
    interpreter); return its result and its log."""
    run = helpers.run_child(
        [python or sys.executable, "-m", "tests.helpers", json.dumps(spec)],
        env or engine_env(),
        ENGINE_TIMEOUT_S,
        REPO,
    )
    assert run.result is not None, f"probe printed no result (exit {run.returncode}):\n{run.log[-4000:]}"
    return run.result, run.log


def node_memory() -> tuple[int, int]:
    """(available, total) bytes of the CPU backend's device, read as vLLM
    reads it: the memory node of the first allowed CPU."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    info = get_memory_node_info(get_allowed_cpu_list()[0].numa_node)
    return int(info.available_memory), int(info.total_memory)


BALLAST = (
    "import sys, time\n"
    "held = bytearray(int(sys.argv[1]))\n"
    "held[::4096] = b'\\x01' * len(range(0, len(held), 4096))  # every page resident\n"
    "print('READY', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def ballast(nbytes: int) -> Iterator[None]:
    """Another process holding ``nbytes`` of resident memory while the block
    runs (it ends when its standard input closes, so it never outlives the
    test)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BALLAST, str(max(0, nbytes))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        time.sleep(0.5)  # let the node's counters settle
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


BALLAST_RESERVE = 2 * 2**30
"""What the ballast always leaves to the rest of the machine (the engines,
pytest): more ballast than the machine's available memory less this fails
the premise instead of pushing the machine out of memory."""
BALLAST_STEP_MIN = 256 * 2**20


@contextlib.contextmanager
def ballast_until(holds: Callable[[int, int], bool], what: str) -> Iterator[tuple[int, int]]:
    """Hold ballast, grown step by step, until ``holds(available, total)`` of
    the CPU backend's node is true; yield (available, total) as it then
    stands, and fail when the machine cannot spare more before it holds.

    A fixed ballast is not enough: these machines add memory to NUMA node 0
    as it is used (its total grew from 7.6 to 24.4 GiB in one session), so
    ballast may first grow the node and lower its available memory only
    once the node has reached the machine's size."""
    import psutil

    with contextlib.ExitStack() as stack:
        held = 0
        while True:
            available, total = node_memory()
            if holds(available, total):
                break
            spare = psutil.virtual_memory().available - BALLAST_RESERVE
            if spare < BALLAST_STEP_MIN:
                pytest.fail(
                    f"premise not met: {what}; {available} of {total} bytes of the node available "
                    f"with {held} bytes of ballast held, and the machine cannot spare more"
                )
            step = min(spare, max(BALLAST_STEP_MIN, available // 4))
            stack.enter_context(ballast(step))
            held += step
        yield available, total


@contextlib.contextmanager
def available_at_most(fraction: float) -> Iterator[tuple[int, int]]:
    """Hold ballast so that at most ``fraction`` of the node is available,
    assert that premise, and yield (available, total) as it then stands."""
    with ballast_until(lambda available, total: available < fraction * total, f"under {fraction:.0%} available") as (
        available,
        total,
    ):
        assert available < fraction * total
        yield available, total


class ProbeDrivers:
    """The probe drivers of a test session (``tests.helpers.ProbeDriver``),
    one per environment and interpreter, the last ``KEEP`` used kept alive:
    probes with the same environment, in one module or several, import
    torch and vLLM once. Each probe still starts its own engine."""

    KEEP = 2

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.drivers: dict[tuple[str | None, tuple[tuple[str, str], ...]], helpers.ProbeDriver] = {}
        self.count = 0

    def run(self, spec: dict[str, Any], env: dict[str, str], python: str | None) -> tuple[dict[str, Any], str]:
        key = (python, tuple(sorted(env.items())))
        driver = self.drivers.pop(key, None)
        if driver is None or not driver.alive:
            driver = helpers.ProbeDriver(env, python, REPO)
        self.drivers[key] = driver  # the most recently used last
        while len(self.drivers) > self.KEEP:
            self.drivers.pop(next(iter(self.drivers))).close()
        self.count += 1
        run = driver.run(spec, self.folder / f"probe-{self.count}.log", ENGINE_TIMEOUT_S)
        assert run.result is not None, f"probe printed no result (exit {run.returncode}):\n{run.log[-4000:]}"
        return run.result, run.log

    def close(self) -> None:
        for driver in self.drivers.values():
            driver.close()
        self.drivers.clear()


@pytest.fixture(scope="session")
def probe(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., tuple[dict, str]]]:
    """``probe(**llm_kwargs)`` starts the tiny model with BASE_ENGINE_ARGS
    plus the given arguments; ``env=`` adds environment variables,
    ``python=`` another interpreter. Probes with the same environment and
    interpreter run one after the other in one driver process."""
    drivers = ProbeDrivers(tmp_path_factory.mktemp("probes"))

    def _probe(
        env: dict[str, str] | None = None, python: str | None = None, **kwargs: Any
    ) -> tuple[dict[str, Any], str]:
        spec = {"model": tiny_model, **BASE_ENGINE_ARGS, **kwargs}
        return drivers.run(spec, engine_env(**(env or {})), python)

    yield _probe
    drivers.close()


def cap_error(result: dict[str, Any], log: str) -> str:
    """The error naming the cap of an engine that failed to start. The
    plugin raises it in the first process as ``KVCacheMaxMemoryError``
    (relayed from the engine core or a worker). Patched vLLM raises
    ``ValueError`` where it finds the problem: in the first process, or in
    the engine core, whose failure the first process reports ("Engine core
    initialization failed"), the error being in the engine core's log.
    The plugin's error is said once, without a traceback, wherever it arose."""
    assert not result["ok"], result
    if not UPSTREAM:
        assert result["error_type"] == "KVCacheMaxMemoryError", result
        # Said once: no traceback of it in the engine core's log (the probe
        # catches what the first process raises).
        assert "Traceback (most recent call last)" not in log, log[-4000:]
        return result["error"]
    if result["error_type"] == "ValueError":
        return result["error"]
    assert "Engine core initialization failed" in result["error"], result
    found = helpers.logged_value_errors(log)
    assert found, log[-4000:]
    return found[-1]


def server_args(model: str, cap: str | None = None, utilization: float | None = None, *extra: str) -> list[str]:
    """CLI arguments of an OpenAI API server with ``model`` served as "tiny"
    (eager, max_model_len 512), with the cap and utilization when given."""
    args = [
        "--model",
        model,
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(TEST_MAX_MODEL_LEN),
        "--enforce-eager",
    ]
    if utilization is not None:
        args += ["--gpu-memory-utilization", str(utilization)]
    if cap is not None:
        args += ["--kv-cache-max-memory", cap]
    return [*args, *extra]


def budget_server_args(model: str, cap: int, budget: int, max_model_len: int, *extra: str) -> list[str]:
    """:func:`server_args` of an autoscaled server under a shared budget
    (``cap`` and ``budget`` in bytes, whole MiB), 64 sequences at most."""
    mib = 2**20
    return server_args(
        model,
        f"{cap // mib}M",
        None,
        "--kv-cache-autoscale",
        "--kv-cache-shared-budget",
        f"{budget // mib}M",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "64",
        *extra,
    )


def complete(base: str, prompt: str = "Hello, my name is", max_tokens: int = 16) -> dict[str, Any]:
    """One greedy completion of exactly ``max_tokens`` tokens from the server at ``base``."""
    import requests

    reply = requests.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


@contextlib.contextmanager
def api_servers(
    servers: dict[str, tuple[list[str], dict[str, str]] | tuple[list[str], dict[str, str], list[str]]], folder: Path
) -> Iterator[dict[str, tuple[str, Path]]]:
    """Start one OpenAI API server per name at the same time (see
    ``tests.helpers.api_servers``), fail unless all answer /health, yield
    ``{name: (base_url, log_path)}``, and stop them all."""
    with helpers.api_servers(servers, folder, ENGINE_TIMEOUT_S, REPO) as running:
        for name, server in running.items():
            if server.ready_s is None:
                state = f"exited {server.returncode}" if server.returncode is not None else "not ready"
                pytest.fail(f"server {name} {state}:\n{server.log_path.read_text()[-4000:]}")
        yield {name: (server.base, server.log_path) for name, server in running.items()}
