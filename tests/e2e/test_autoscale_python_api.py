"""Autoscaling through the Python API on a real CPU engine:
``LLM(model, kv_cache_max_memory=..., kv_cache_autoscale=True)`` with no
extra import starts at its floor and grows for a batch that needs more,
and leaves its shared budget's ledger as it exits; an explicit floor above
one request is where it starts, and a resize below that floor is refused
naming it; tensor parallel 2 on one memory node counts both workers' blocks
in the budget; a floor that cannot hold one request fails at start-up,
quoted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.conftest import cap_error
from tests.e2e.test_side_by_side import bind_two_workers
from tests.helpers import live_ledger_entries

pytestmark = [pytest.mark.plugin_only, pytest.mark.smoke]  # autoscaling is the plugin's; every CPU build

PROMPT = "the quick brown fox jumps over the lazy dog " * 40
"""About 360 tokens: 3 blocks of 128 tokens a request."""
FORCE_KILLED = "[shutdown] Process manager: force killing remaining process EngineCore"
"""vLLM's client gives the engine core 5 s after its SIGTERM, then kills it:
on a loaded machine its workers alone took 4 s to exit, and a kill before
the engine core's shutdown ends leaves its ledger entry's file, unlocked
(the kernel dropped its lock), for the next reader to remove."""


def test_llm_autoscaled_starts_at_its_floor_and_grows_for_a_batch(probe, tmp_path: Path) -> None:
    prompts = [f"{i} {PROMPT}" for i in range(12)]
    locks = tmp_path / "locks"
    result, log = probe(
        env={"VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(locks)},
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_shared_budget="32M",
        prompts=prompts,
        max_tokens=16,
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    # It took its place in the device's ledger, and its exit left no live
    # entry: a clean one removed it (not left to the next instance's reader).
    ledgers = list(locks.glob("budget-*"))
    assert len(ledgers) == 1 and (ledgers[0] / "ledger.lock").is_file(), sorted(locks.rglob("*"))
    left = sorted(ledgers[0].glob("*.entry"))
    assert live_ledger_entries(locks) == 0, (left, log[-3000:])
    if FORCE_KILLED not in log:
        assert not left, (left, log[-3000:])
    assert "shared budget 32MiB of host memory node 0 (CPU backend), others hold 0B (none)" in log, log[-3000:]
    assert result["kv_cache_bytes"] == [16 * 2**20]  # allocated at start-up: the most it can grow to
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    floor, allocated = int(started[1]), int(started[2])
    # max_model_len 512 needs 4 blocks of 128 tokens, plus vLLM's null block.
    assert floor == 5 and allocated == result["num_gpu_blocks"]
    grown = [
        int(m[1]) for m in re.finditer(r"KV cache autoscale: limit \S+ -> \S+ per worker \(\d+ -> (\d+) blocks", log)
    ]
    # 12 requests of 3 blocks do not fit in the floor: the limit grew, and every request finished.
    assert grown and max(grown) > 12 * 3, grown
    assert len(result["texts"]) == len(prompts) and all(result["texts"])


def test_explicit_floor_is_the_start_and_a_resize_below_it_is_refused(probe) -> None:
    # Floor 4M, resize to 2M: above one request (refused by resize itself
    # otherwise), below the floor (refused by the autoscaler, naming it).
    result, log = probe(
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_min_memory="4M",
        prompts=[PROMPT],
        max_tokens=4,
        resize_to="2M",
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    floor, allocated = int(started[1]), int(started[2])
    bytes_per_block = 16 * 2**20 // allocated
    # Premise: 2M lies between one request of max_model_len 512 (4 blocks
    # plus the null block) and the floor, which holds 4M.
    assert 5 * bytes_per_block < 2 * 2**20 < floor * bytes_per_block <= 4 * 2**20, (floor, bytes_per_block)
    assert "resize" not in result, result
    error = result["resize_error"]
    assert error["error_type"] == "KVCacheResizeError", error
    assert "Cannot set the KV cache limit to 2MiB (2097152 bytes) while autoscaling" in error["error"], error
    assert "below the floor, --kv-cache-min-memory" in error["error"], error
    # Refused: the limit is still the floor.
    assert result["status"]["kv_cache_limit_bytes"] == floor * bytes_per_block, result["status"]
    assert len(result["texts"]) == 1 and result["texts"][0]


GROWN = re.compile(
    r"KV cache autoscale: limit \S+ -> \S+ per worker \(\d+ -> (\d+) blocks of \d+ allocated; demand (\d+)"
)


def test_tensor_parallel_workers_on_one_node_share_its_budget(probe, tmp_path: Path) -> None:
    # Both workers keep their KV cache in memory node 0: the budget of 8M
    # for the node holds 4M a worker, though the cap is 16M a worker.
    budget = 8 * 2**20
    result, log = probe(
        env={
            "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(tmp_path / "locks"),
            "VLLM_CPU_OMP_THREADS_BIND": bind_two_workers("tensor-parallel worker"),
        },
        tensor_parallel_size=2,
        kv_cache_max_memory="16M",
        kv_cache_autoscale=True,
        kv_cache_shared_budget="8M",
        prompts=[f"{i} {PROMPT}" for i in range(48)],
        max_tokens=16,
    )
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    assert result["kv_cache_bytes"] == [16 * 2**20] * 2  # each worker allocated the cap
    started = re.search(r"KV cache autoscale on: limit \S+ per worker \(the floor, (\d+) of (\d+) blocks\)", log)
    assert started, log[-3000:]
    bytes_per_block = 16 * 2**20 // int(started[2])  # a worker's
    grown = [(int(m[1]), int(m[2])) for m in GROWN.finditer(log)]
    assert grown, log[-3000:]
    # 48 requests of 3 blocks ask for more than the budget holds for two
    # workers (64 blocks each here): the limit grew to that and no further,
    # though the cap allows 4 times as many blocks.
    most = max(limit for limit, _ in grown)
    assert most == budget // (2 * bytes_per_block), (most, bytes_per_block, grown)
    status = result["status"]
    assert status["autoscale"]["held_bytes"] == 2 * status["kv_cache_limit_bytes"], status
    assert len(result["texts"]) == 48 and all(result["texts"])


def test_floor_that_cannot_hold_one_request_fails_at_startup_quoted(probe) -> None:
    result, log = probe(kv_cache_max_memory="16M", kv_cache_autoscale=True, kv_cache_min_memory="300K")
    message = cap_error(result, log)
    assert "--kv-cache-min-memory 300KiB is refused" in message, message
    assert "one request of max_model_len 512 needs 4 blocks" in message, message
    assert re.search(r"Choose a size of at least \S+ \(\d+ bytes\)", message), message


IN_PROCESS = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())  # the repository's root: tests.helpers
from vllm import LLM, SamplingParams
import vllm_kv_cache_limit as kvl
from tests.helpers import enter_engine_process, kv_cache_resident_bytes, ledger_holds, live_ledger_entries

def rss_fall(worker):
    # How far the worker's RSS (less LazyFree: the idle fall releases lazily) fell at its
    # last release, measured around its madvise calls.
    from vllm_kv_cache_limit.hooks.worker_state import WorkerState

    state = WorkerState.peek(worker)
    return 0 if state is None else state.rss_fall

if __name__ == "__main__":
    enter_engine_process()
    spec = json.loads(sys.argv[1])
    locks = Path(os.environ["VLLM_KV_CACHE_LIMIT_LOCK_DIR"])
    llm = LLM(spec["model"], kv_cache_max_memory="16M", kv_cache_autoscale=True, kv_cache_shared_budget="32M",
              max_model_len=512, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=16, temperature=0)
    texts = lambda: [o.outputs[0].text for o in llm.generate(spec["prompts"], params, use_tqdm=False)]
    result = {"client": type(llm.llm_engine.engine_core).__name__, "first": texts()}
    result["busy"] = kvl.kv_cache_limit_status(llm)
    result["busy_holds"] = ledger_holds(locks)
    result["busy_resident"] = llm.collective_rpc(kv_cache_resident_bytes)
    # Idle: no call into the engine at all, and the ledger read from outside.
    time.sleep(spec["idle_s"])
    result["idle_holds"] = ledger_holds(locks)
    result["idle"] = kvl.kv_cache_limit_status(llm)
    result["idle_resident"] = llm.collective_rpc(kv_cache_resident_bytes)
    result["rss_fall"] = llm.collective_rpc(rss_fall)
    # Calls again, while the timer decides between them: the same greedy outputs.
    result["second"] = texts()
    result["again"] = kvl.kv_cache_limit_status(llm)
    llm.llm_engine.engine_core.shutdown()
    result["entries_after"] = len(list(locks.glob("budget-*/*.entry"))) + live_ledger_entries(locks)
    print("RESULT " + json.dumps(result), flush=True)
"""


def test_in_process_engine_falls_to_its_floor_while_the_caller_makes_no_call(tiny_model: str, tmp_path: Path) -> None:
    """vLLM's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    takes a step only inside the caller's calls: idle, its own timer lowers
    the limit to the floor, gives the budget back in the ledger and returns
    the pages to the OS, and calls made while it decides are unaffected."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.helpers import engine_env

    locks = tmp_path / "locks"
    driver = tmp_path / "driver.py"
    driver.write_text(IN_PROCESS)
    spec = {"model": tiny_model, "prompts": [f"{i} {PROMPT}" for i in range(12)], "idle_s": 6}
    run = subprocess.run(
        [sys.executable, str(driver), json.dumps(spec)],
        env=engine_env(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_KV_CACHE_LIMIT_LOCK_DIR=str(locks),
            VLLM_KV_CACHE_LIMIT_SHRINK_AFTER_S="1",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"exit {run.returncode}:\n{log[-4000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["client"] == "InprocClient", result["client"]
    busy, idle, again = result["busy"], result["idle"], result["again"]
    floor = busy["autoscale"]["floor_bytes"]
    bpb = busy["kv_cache_allocated_bytes"] // busy["num_blocks_allocated"]
    # The premise: the batch grew the limit, the ledger holds it, and pages
    # above the floor became resident.
    assert busy["kv_cache_limit_bytes"] > floor, busy
    assert result["busy_holds"] == [busy["autoscale"]["held_bytes"]] and result["busy_holds"][0] > floor, result
    assert result["busy_resident"][0] > floor + 4 * bpb, (result["busy_resident"], floor, bpb)
    # Idle with no call: at the floor, its share given back, its pages released
    # (lazily, after idling: LazyFree, which the resident bytes leave out).
    assert idle["kv_cache_limit_bytes"] == floor and idle["holds"], idle
    assert result["idle_holds"] == [floor], (result["idle_holds"], floor)
    # (Pages that straddle the floor's last block in each layer stay.)
    assert result["idle_resident"][0] <= floor + 2 * bpb, (result["idle_resident"], floor, bpb)
    fell = result["busy_resident"][0] - result["idle_resident"][0]
    assert result["rss_fall"][0] >= 0.9 * fell > 0, (result["rss_fall"], fell)
    assert re.search(r"KV cache autoscale: limit \S+ -> \S+ per worker .*demand below the limit for 1 s", log), log[
        -3000:
    ]
    # The next batch grows it again and gives the same greedy outputs.
    assert result["second"] == result["first"] and all(result["first"])
    assert again["autoscale"]["changes"] > idle["autoscale"]["changes"], (idle, again)
    assert "KV cache autoscaling failed" not in log, log[-3000:]
    assert result["entries_after"] == 0, result
