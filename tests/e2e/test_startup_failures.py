"""Every start-up error leaves nothing behind: the API server exits non-zero
with the message in its last lines, ``LLM(...)`` raises it, and no
engine-core or worker process of the run remains.

Processes of a run are found two ways: the launched process's descendants,
sampled while it runs, and any process on the machine whose environment
carries the run's marker (engine-core and worker processes inherit it, so a
process that was re-parented after its parent died is still found)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.conftest import BASE_ENGINE_ARGS, ENGINE_TIMEOUT_S, REPO, engine_env
from tests.e2e.test_version_drift import drift_env
from tests.helpers import free_port
from vllm_kv_cache_limit import compat

RUN_MARKER = "VLLM_KV_CACHE_LIMIT_TEST_RUN"
MiB = 2**20
GRACE_S = 30.0
"""How long processes of a failed run may take to exit."""
ENGINE_RECORD = re.compile(r"\((EngineCore\w*|Worker\w*) pid=(\d+)\)")
"""vLLM's tag on a log record from an engine-core or worker process."""

DRIVER = textwrap.dedent(
    '''
    """Start LLM(...) with the given arguments; report the error and which
    child processes are still alive once it has been raised."""
    import json
    import sys
    import time

    import psutil


    def alive_children():
        found = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    found.append({"pid": child.pid, "name": child.name(), "cmdline": " ".join(child.cmdline())})
            except psutil.Error:
                pass
        return found


    if __name__ == "__main__":
        from vllm import LLM

        error = None
        try:
            LLM(**json.loads(sys.argv[1]))
        except Exception as exc:
            error = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
        # Waits for the engine's processes, not for Python's resource tracker
        # (it lives as long as this process).
        deadline = time.monotonic() + float(sys.argv[2])
        while time.monotonic() < deadline and any(
            "multiprocessing.resource_tracker" not in child["cmdline"] for child in alive_children()
        ):
            time.sleep(0.2)
        print("DRIVER_RESULT " + json.dumps({"error": error, "children": alive_children()}), flush=True)
    '''
)


def node_total_memory() -> int:
    """Total memory of the CPU backend's device, read as vLLM reads it."""
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    return get_memory_node_info(0).total_memory


def failure_case(name: str, tmp_path: Path) -> tuple[str, dict[str, str], list[str]]:
    """(cap, extra environment, fragments the error must contain)."""
    if name == "above_free":
        cap = node_total_memory() - 64 * MiB  # under the total, above what is free
        return str(cap), {}, ["cannot fit on the host memory node", "is free, less than the cap plus the weights"]
    if name == "too_small":
        return "64K", {}, ["is too small for one request of max_model_len=512"]
    if name == "unsupported_vllm":
        env, problem = drift_env(tmp_path, "missing")
        return (
            "16M",
            env,
            [
                f"cannot enforce --kv-cache-max-memory on the installed vLLM {compat.installed_vllm_version()}",
                compat.SUPPORTED_VLLM[0],
                problem,
            ],
        )
    raise KeyError(name)


CASES = ["above_free", "too_small", "unsupported_vllm"]
ERROR_TYPES = {"unsupported_vllm": "UnsupportedVLLMError"}
"""The error class of each case, where it is not ``KVCacheMaxMemoryError``
itself (a vLLM that changed has its own, a ``KVCacheMaxMemoryError``)."""


def marked_processes(marker: str) -> list[dict[str, Any]]:
    """Live processes whose environment carries the run's marker."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if proc.environ().get(RUN_MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(
                    {"pid": proc.pid, "name": proc.info["name"], "cmdline": " ".join(proc.info["cmdline"] or [])}
                )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def still_alive(seen: dict[int, tuple[float, str]]) -> list[str]:
    """Processes seen during the run that still exist (same pid and start
    time, or any start time for a pid known only from the log, as 0.0; not a
    zombie)."""
    alive = []
    for pid, (created, what) in seen.items():
        try:
            proc = psutil.Process(pid)
            if created in (0.0, proc.create_time()) and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {what}")
        except psutil.NoSuchProcess:
            continue
    return alive


def wait_until_gone(marker: str, seen: dict[int, tuple[float, str]]) -> tuple[list[dict[str, Any]], list[str]]:
    deadline = time.monotonic() + GRACE_S
    while True:
        marked, alive = marked_processes(marker), still_alive(seen)
        if (not marked and not alive) or time.monotonic() > deadline:
            return marked, alive
        time.sleep(0.5)


def run_watched(command: list[str], env: dict[str, str], log_path: Path) -> tuple[int, dict[int, tuple[float, str]]]:
    """Run ``command`` to its end, sampling its descendants as it runs: each
    one's start time and every command line it showed, joined by " | "."""
    seen: dict[int, tuple[float, str]] = {}
    with open(log_path, "w") as log:
        proc = psutil.Popen(command, stdout=log, stderr=log, env=env, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"{command[2]} did not exit within {ENGINE_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")
            try:
                for child in proc.children(recursive=True):
                    try:
                        # Every distinct command line is kept: a child caught
                        # between fork and exec still shows its parent's, and
                        # one caught while it sets its process title a torn one.
                        what = " ".join(child.cmdline())[:400]
                        started, known = seen.get(child.pid, (child.create_time(), ""))
                        if what not in known.split(" | "):
                            known = f"{known} | {what}" if known else what
                        seen[child.pid] = (started, known)
                    except psutil.Error:
                        pass
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.2)
        return proc.returncode, seen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("case", CASES)
def test_llm_raises_and_leaves_no_process(tiny_model: str, tmp_path: Path, case: str) -> None:
    cap, extra_env, fragments = failure_case(case, tmp_path)
    marker = uuid.uuid4().hex
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    spec = {"model": tiny_model, **BASE_ENGINE_ARGS, "kv_cache_max_memory": cap}
    env = engine_env(**extra_env, **{RUN_MARKER: marker})
    log_path = tmp_path / "llm.log"
    status, seen = run_watched([sys.executable, str(driver), json.dumps(spec), str(GRACE_S)], env, log_path)
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if line.startswith("DRIVER_RESULT ")]
    assert lines, f"exit {status}:\n{log[-4000:]}"
    result = json.loads(lines[-1][len("DRIVER_RESULT ") :])

    error = result["error"]
    assert error is not None, "LLM(...) started despite the bad cap"
    assert error["type"] == ERROR_TYPES.get(case, "KVCacheMaxMemoryError"), error
    assert "KVCacheMaxMemoryError" in error["mro"] and "ValueError" in error["mro"], error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    # Right after LLM(...) raised, in the still running caller: no engine
    # core or worker. (Python's multiprocessing resource tracker, started by
    # the first spawn, lives as long as its parent by design.)
    engine_children = [c for c in result["children"] if "multiprocessing.resource_tracker" not in c["cmdline"]]
    assert engine_children == [], result["children"]
    # And after the caller exited, anywhere on the machine:
    marked, alive = wait_until_gone(marker, seen)
    assert marked == [] and alive == [], (marked, alive)


@pytest.mark.parametrize("case", CASES)
def test_api_server_exits_with_message_and_leaves_no_process(tiny_model: str, tmp_path: Path, case: str) -> None:
    cap, extra_env, fragments = failure_case(case, tmp_path)
    marker = uuid.uuid4().hex
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tiny_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        str(BASE_ENGINE_ARGS["gpu_memory_utilization"]),
        "--enforce-eager",
        "--kv-cache-max-memory",
        cap,
    ]
    log_path = tmp_path / "server.log"
    status, seen = run_watched(command, engine_env(**extra_env, **{RUN_MARKER: marker}), log_path)
    log = log_path.read_text()
    assert status != 0, log[-3000:]
    last = "\n".join(log.splitlines()[-30:])
    assert ERROR_TYPES.get(case, "KVCacheMaxMemoryError") in last, last
    for fragment in fragments:
        assert fragment in last, last
    if case == "too_small":  # the others fail in the first process, before any engine
        # vLLM tags each log record with its process's name and pid: the
        # engine core ran (else this run would check no clean-up) ...
        logged = {int(pid): name for name, pid in ENGINE_RECORD.findall(log)}
        assert any(name.startswith("EngineCore") for name in logged.values()), (
            "the engine core never started, so this run checks no clean-up",
            logged,
            seen,
        )
        # ... and none of its processes outlives the server.
        seen = {**{pid: (0.0, name) for pid, name in logged.items()}, **seen}
    marked, alive = wait_until_gone(marker, seen)
    assert marked == [] and alive == [], (marked, alive)
