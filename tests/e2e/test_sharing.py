"""Sharing one device: with a cap, an instance starts whenever it fits, in
any order, without tuning --gpu-memory-utilization; three servers side by
side each hold the whole blocks of their own cap and serve concurrent
completions. Real vLLM CPU engines; each test first creates and asserts the
condition vLLM alone refuses."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.e2e.conftest import (
    api_servers,
    available_at_most,
    ballast_until,
    complete,
    engine_env,
    node_memory,
    run_probe,
    server_args,
)
from tests.e2e.test_side_by_side import kv_bytes_per_block, metric_labels, metric_sum
from tests.e2e.test_startup_failures import RUN_MARKER, run_watched, wait_until_gone

# Runs alone (tests/conftest.py, ALONE_MODULES): premises on the memory node's free memory.
MiB = 2**20
GiB = 2**30
CPU_DEFAULT_UTILIZATION = 0.92
"""vLLM's CPU backend asks for 92% of the node by default."""
NOT_FREE = 0.85
"""The tests hold ballast so that at most this share of the node is
available: vLLM's default request of 92% cannot be met."""
ENGINE_ARGS = {"max_model_len": 512, "enforce_eager": True, "seed": 0}  # default utilization


@pytest.mark.smoke
def test_cap_starts_where_vllms_gate_refuses(tiny_model: str) -> None:
    spec = {"model": tiny_model, **ENGINE_ARGS}
    with available_at_most(NOT_FREE) as (available, total):
        assert available < CPU_DEFAULT_UTILIZATION * total
        refused, _ = run_probe(spec)  # the premise: vLLM alone refuses
        started, log = run_probe({**spec, "kv_cache_max_memory": "16M"})
    assert not refused["ok"]
    assert "less than desired CPU memory utilization (0.92" in refused["error"] + refused.get("error_type", "") or (
        "Engine core initialization failed" in refused["error"]
    ), refused
    assert started["ok"], f"{started.get('error_type')}: {started.get('error')}\n{log[-3000:]}"
    assert started["kv_cache_bytes"] == [16 * MiB]  # measured in the worker: exactly the cap
    assert started["texts"] and started["texts"][0]
    assert re.search(
        r"--gpu-memory-utilization 0\.92 asks for .* GiB is free at start-up; with "
        r"--kv-cache-max-memory the utilization is a ceiling",
        log,
    ), log[-3000:]


def test_vllms_gate_error_without_the_plugin(tiny_model: str) -> None:
    """The same premise with the plugin excluded: vLLM's own message."""
    spec = {"model": tiny_model, **ENGINE_ARGS}
    with available_at_most(NOT_FREE):
        refused, log = run_probe(spec, engine_env(VLLM_PLUGINS=""))
    assert not refused["ok"]
    assert "is less than desired CPU memory utilization (0.92" in log, log[-3000:]


# --- three servers launched at the same instant ------------------------------

CAPS = {"a": 16 * MiB, "b": 32 * MiB, "c": 48 * MiB}
LOCK_RE = re.compile(r"start-up lock (acquired|released) .*?acquired at (\d+\.\d+)(?:, released at (\d+\.\d+))?")
SNAPSHOT_RE = re.compile(r"memory snapshot at (\d+\.\d+)\)")


@pytest.fixture(scope="module")
def three_servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("three-servers")
    specs = {}
    for name, cap in CAPS.items():
        env = engine_env(VLLM_SERVER_DEV_MODE="1", VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(folder / "locks"))
        args = server_args(tiny_model, f"{cap // MiB}M", None, "--worker-extension-cls", "tests.helpers.KVCacheProbe")
        specs[name] = (args, env)
    with available_at_most(NOT_FREE):
        with api_servers(specs, folder) as running:
            yield running


def lock_window(log: str) -> tuple[float, float]:
    acquired = [float(m[2]) for m in LOCK_RE.finditer(log) if m[1] == "acquired"]
    released = [float(m[3]) for m in LOCK_RE.finditer(log) if m[1] == "released"]
    assert len(acquired) == 1 and len(released) == 1, log[-3000:]
    return acquired[0], released[0]


def test_three_servers_each_hold_exactly_their_cap(three_servers) -> None:
    for name, (base, _) in three_servers.items():
        reply = requests.post(f"{base}/collective_rpc", json={"method": "kv_cache_bytes"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert [int(b) for b in reply.json()["results"]] == [CAPS[name]], name


REQUESTS_PER_SERVER = 3
PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time"]


def test_three_servers_answer_concurrent_completions(three_servers) -> None:
    jobs = [(base, prompt) for base, _ in three_servers.values() for prompt in PROMPTS[:REQUESTS_PER_SERVER]]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        replies = list(pool.map(lambda job: complete(*job, max_tokens=8), jobs))
    assert len(replies) == len(CAPS) * REQUESTS_PER_SERVER
    for reply in replies:
        assert reply["usage"]["completion_tokens"] == 8, reply
        assert isinstance(reply["choices"][0]["text"], str)
    # Each server counted its own requests.
    for name, (base, _) in three_servers.items():
        metrics = requests.get(f"{base}/metrics", timeout=30).text
        assert metric_sum(metrics, "vllm:request_success_total") >= REQUESTS_PER_SERVER, name


@pytest.mark.parametrize("name", sorted(CAPS))
def test_each_server_holds_the_whole_blocks_of_its_own_cap(three_servers, tiny_model: str, name: str) -> None:
    """Side by side, each server sizes its KV cache by its own cap, as its
    metrics, its INFO line and vLLM's own account say."""
    base, log_path = three_servers[name]
    cap = CAPS[name]
    info = metric_labels(requests.get(f"{base}/metrics", timeout=30).text, "vllm:cache_config_info")
    assert int(info["kv_cache_max_memory"]) == cap
    blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
    per_block = kv_bytes_per_block(tiny_model, block_size)
    # The whole blocks that fit in this server's cap: no more, and no fewer.
    assert blocks * per_block <= cap < (blocks + 1) * per_block

    log = log_path.read_text()
    line = re.search(r"KV cache max memory: \S+ = (\d+) bytes.*?(\d+) blocks, (\d+) tokens", log)
    assert line, log[-3000:]
    assert int(line[1]) == cap and int(line[2]) == blocks and int(line[3]) == blocks * block_size
    # vLLM's own account of the KV cache it made.
    tokens = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert tokens and int(tokens[1].replace(",", "")) * per_block // block_size <= cap


def test_three_servers_have_block_counts_in_the_ratio_of_their_caps(three_servers) -> None:
    counts = {
        name: int(
            metric_labels(requests.get(f"{base}/metrics", timeout=30).text, "vllm:cache_config_info")["num_gpu_blocks"]
        )
        for name, (base, _) in three_servers.items()
    }
    assert counts["b"] == 2 * counts["a"] and counts["c"] == 3 * counts["a"], counts


def test_three_servers_measured_memory_one_at_a_time(three_servers) -> None:
    """Each instance's worker took its memory snapshot and sized its KV cache
    inside its start-up lock, and no two locks were held at once."""
    windows = []
    for name, (_, log_path) in three_servers.items():
        log = log_path.read_text()
        start, end = lock_window(log)
        snapshots = [float(t) for t in SNAPSHOT_RE.findall(log)]
        assert len(snapshots) == 1 and start <= snapshots[0] <= end, (name, start, snapshots, end)
        assert "--gpu-memory-utilization 0.92" in log  # default utilization, not tuned
        windows.append((start, end, name))
    windows.sort()
    for (_, end, first), (start, _, second) in zip(windows, windows[1:]):
        assert end <= start, f"{first}'s window [.., {end}] overlaps {second}'s [{start}, ..]"
    # They were launched together: the later ones waited for the lock.
    logs = "".join(path.read_text() for _, path in three_servers.values())
    assert logs.count("Waiting for the KV cache start-up lock") >= 1


# --- a cap that cannot fit ---------------------------------------------------

DRIVER = textwrap.dedent(
    '''
    """Read the node's available memory, start LLM(...) with a cap derived
    from it, and report the error, when LLM() was called and how long it took
    to fail."""
    import json, sys, time

    if __name__ == "__main__":
        from vllm import LLM
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        spec, below = json.loads(sys.argv[1]), int(sys.argv[2])
        available = get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory
        # A cap above what is left (below < 0) clears the 1% tolerance as well.
        tolerance = available // 100 if below < 0 else 0
        spec["kv_cache_max_memory"] = available + tolerance - below
        started = time.perf_counter()
        error = None
        try:
            LLM(**spec)
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc)}
        print("DRIVER_RESULT " + json.dumps({"error": error, "seconds": time.perf_counter() - started,
              "cap": spec["kv_cache_max_memory"], "available": available}), flush=True)
    '''
)


def run_driver(tiny_model: str, tmp_path: Path, below: int) -> tuple[dict, str, dict]:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    marker = uuid.uuid4().hex
    log_path = tmp_path / "llm.log"
    spec = {"model": tiny_model, **ENGINE_ARGS}
    status, seen = run_watched(
        [sys.executable, str(driver), json.dumps(spec), str(below)],
        engine_env(**{RUN_MARKER: marker}),
        log_path,
    )
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if line.startswith("DRIVER_RESULT ")]
    assert lines, f"exit {status}:\n{log[-4000:]}"
    marked, alive = wait_until_gone(marker, seen)
    assert marked == [] and alive == [], (marked, alive)  # nothing left behind
    return json.loads(lines[-1][len("DRIVER_RESULT ") :]), log, seen


def test_cap_that_cannot_fit_fails_before_weights_load(tiny_model: str, tmp_path: Path) -> None:
    """Ballast holds most of the free memory; a cap 256 MiB above what is
    left and its 1% tolerance, which would have fit without the ballast,
    fails in the first process, before any engine process starts."""
    before, _ = node_memory()
    # The premise: ballast lowers the node's available memory by more than a
    # GiB, so that the cap (256 MiB above what is then left) would have fit
    # without it.
    with ballast_until(lambda available, _: available < before - GiB, "the ballast lowers available by 1 GiB"):
        result, log, seen = run_driver(tiny_model, tmp_path, below=-256 * MiB)
    assert result["available"] < before - GiB, (result, before)  # as the driver read it
    assert result["cap"] < before  # ... and the cap would have fit without it
    error = result["error"]
    assert error and error["type"] == "KVCacheMaxMemoryError", (error, log[-3000:])
    assert "cannot fit on the host memory node" in error["message"]
    assert f"({result['cap']} bytes" in error["message"]
    assert re.search(r"\(\d+ bytes\) is free", error["message"])
    suggested = re.search(r"Choose at most --kv-cache-max-memory (\S+?),", error["message"])
    assert suggested, error["message"]
    assert "Loading weights" not in log and "EngineCore" not in log
    # No engine-core or worker process was ever started (a short-lived shell
    # child, such as vLLM's lscpu call, may be seen; it is not an engine).
    engines = [what for _, what in seen.values() if "multiprocessing" in what or "VLLM::" in what]
    assert not engines, seen
    print(f"cap refused {result['seconds']:.2f} s after LLM() was called")
    assert result["seconds"] < 30


def test_cap_above_what_the_instance_can_get_fails_after_profiling(tiny_model: str, tmp_path: Path) -> None:
    """A cap 300 MiB under what is available when LLM() is called passes
    the check before loading; but the engine core and worker processes then
    need more than that, so after profiling the cap cannot be given."""
    with available_at_most(NOT_FREE):
        result, log, _ = run_driver(tiny_model, tmp_path, below=300 * MiB)
    error = result["error"]
    assert error and error["type"] == "KVCacheMaxMemoryError", (error, log[-3000:])
    message = error["message"]
    assert "can still give this instance" in message, message
    assert "was free at start-up" in message and "besides its KV cache" in message
    fit = re.search(r"for example --kv-cache-max-memory (\S+?),", message)
    assert fit, message
    from vllm_kv_cache_limit.logic.sizes import parse_size

    assert parse_size(fit[1]) < result["cap"]
    assert "Loading weights" in log or "Starting to load model" in log  # it did get that far
