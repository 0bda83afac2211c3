"""The cap on a real GPU (``cuda:0``), measured in the worker with
``torch.cuda``: it holds, a cap above the free memory fails before the
weights load, and two capped engines share one GPU in any order."""

from __future__ import annotations

import re

import pytest

MiB = 2**20
GiB = 2**30
NON_KV_SLACK = 2 * GiB
"""What the worker's torch allocator may hold besides weights and KV cache
(input, sampler and workspace buffers). The budget vLLM would give the KV
cache without the cap is tens of GiB on a large GPU, so the check still
tells a capped cache from an uncapped one."""

CAP = 512 * MiB
INFO_LINE = re.compile(r"KV cache max memory: \S+ = (\d+) bytes.*?(\d+) blocks")


def check_worker(worker: dict, cap: int) -> None:
    assert worker["device"] == "cuda:0"
    assert worker["kv_devices"] == ["cuda:0"], worker
    assert 0 < worker["kv_cache_bytes"] <= cap, worker
    # The KV cache lives in torch's allocator, and the allocator holds little
    # besides it and the weights.
    assert worker["kv_cache_bytes"] <= worker["memory_allocated"]
    assert worker["memory_allocated"] <= cap + worker["weights_bytes"] + NON_KV_SLACK, worker


def summary(record_property, text: str) -> None:
    """One line for scripts/gpu-check.sh's report."""
    record_property("summary", text)


def test_cap_holds_on_cuda0(start_engine, record_property) -> None:
    engine = start_engine("capped", gpu_memory_utilization=0.3, kv_cache_max_memory=f"{CAP // MiB}M")
    engine.proc.wait(timeout=600)
    result = engine.wait_result()
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{engine.log[-4000:]}"
    assert result["kv_cache_max_memory"] == CAP
    (worker,) = result["workers"]
    check_worker(worker, CAP)
    # Whole blocks: no room for one more block under the cap.
    per_block = worker["kv_cache_bytes"] // result["num_gpu_blocks"]
    assert worker["kv_cache_bytes"] == result["num_gpu_blocks"] * per_block
    assert CAP - worker["kv_cache_bytes"] < per_block
    # The cap, not vLLM's own budget (30% of the GPU), decided the size.
    assert 0.3 * worker["total"] > 10 * CAP
    line = INFO_LINE.search(engine.log)
    assert line and int(line[1]) == CAP and int(line[2]) == result["num_gpu_blocks"], engine.log[-3000:]
    assert result["texts"] and all(isinstance(t, str) for t in result["texts"])
    summary(
        record_property,
        f"cap {CAP // MiB} MiB holds on cuda:0: KV cache {worker['kv_cache_bytes'] / MiB:.1f} MiB "
        f"({result['num_gpu_blocks']} blocks), torch.cuda.memory_allocated "
        f"{worker['memory_allocated'] / MiB:.1f} MiB (weights {worker['weights_bytes'] / MiB:.1f} MiB)",
    )


def test_cap_above_free_memory_fails_before_weights_load(start_engine, record_property) -> None:
    """Memory held by another process leaves less free than the cap: the
    first process refuses (NVML's free memory) before any weights load."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    keep_free = int(0.45 * total)
    if free < keep_free + GiB:
        pytest.fail(f"cuda:0 has only {free / GiB:.1f} GiB free of {total / GiB:.1f} GiB; the check needs an idle GPU")
    blocker = torch.empty(free - keep_free, dtype=torch.uint8, device="cuda:0")
    try:
        free_before, _ = torch.cuda.mem_get_info(0)
        cap = int(0.6 * total)  # below the total (passes the first check), above the free memory
        assert free_before < cap < total
        engine = start_engine("above-free", gpu_memory_utilization=0.3, kv_cache_max_memory=str(cap))
        engine.proc.wait(timeout=600)
        result = engine.wait_result()
        free_after, _ = torch.cuda.mem_get_info(0)
    finally:
        del blocker
        torch.cuda.empty_cache()
    assert not result["ok"], "the engine started although the cap is above the free memory"
    assert result["error_type"] == "KVCacheMaxMemoryError", result
    assert "cannot fit on the cuda:0" in result["error"], result["error"]
    log = engine.log
    assert "Loading weights" not in log and "Available KV cache memory" not in log
    assert free_after >= free_before - 256 * MiB, (free_before, free_after)
    summary(
        record_property,
        f"cap {cap / GiB:.1f} GiB above {free_before / GiB:.1f} GiB free fails before weights load: "
        f"{result['error'][:120]}",
    )


@pytest.mark.parametrize("order", ["a-then-b", "b-then-a", "at-once"])
def test_two_capped_engines_share_one_gpu(start_engine, record_property, order: str) -> None:
    """Two engines on cuda:0 at the same time, default utilization, each
    within its own cap, started in either order or at once, while another
    process holds 20% of the GPU (so vLLM's default request of 90% cannot
    be free: the premise, asserted). Both generate."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    blocker = torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda:0")
    try:
        assert torch.cuda.mem_get_info(0)[0] < 0.9 * total  # vLLM alone would refuse
        caps = {"a": 256 * MiB, "b": 512 * MiB}
        names = ["b", "a"] if order == "b-then-a" else ["a", "b"]
        engines, ready = {}, {}
        for name in names:
            engines[name] = start_engine(name, hold=True, kv_cache_max_memory=f"{caps[name] // MiB}M")
            if order != "at-once":
                ready[name] = engines[name].wait_result()
        for name in names:
            ready.setdefault(name, engines[name].wait_result())
        for name in names:
            assert ready[name].get("ready"), f"{name}: {ready[name]}\n{engines[name].log[-4000:]}"
        for name, result in ready.items():
            (worker,) = result["workers"]
            check_worker(worker, caps[name])
            assert "utilization is a ceiling" in engines[name].log
        done = {name: engine.finish() for name, engine in engines.items()}
    finally:
        del blocker
        torch.cuda.empty_cache()
    for name, result in done.items():
        assert result["ok"], f"{name}: {result.get('error')}"
        assert result["texts"]
    summary(
        record_property,
        f"two engines share cuda:0 ({order}, default utilization, 20% held elsewhere): "
        + ", ".join(
            f"{name} cap {caps[name] // MiB} MiB -> KV {ready[name]['workers'][0]['kv_cache_bytes'] / MiB:.1f} MiB"
            for name in caps
        ),
    )


def test_cap_holds_with_cuda_graphs(start_engine, record_property) -> None:
    """CUDA graphs on (not enforce_eager): vLLM's CUDA graph memory estimate
    and capture run; the KV cache still keeps to the cap."""
    engine = start_engine(
        "graphs", enforce_eager=False, gpu_memory_utilization=0.3, kv_cache_max_memory=f"{CAP // MiB}M"
    )
    result = _run_to_end(engine)
    (worker,) = result["workers"]
    check_worker(worker, CAP)
    assert CAP - worker["kv_cache_bytes"] < worker["kv_cache_bytes"] // result["num_gpu_blocks"]
    summary(
        record_property, f"CUDA graphs on: KV {worker['kv_cache_bytes'] / MiB:.1f} MiB under a {CAP // MiB} MiB cap"
    )


@pytest.mark.parametrize(("explicit", "cap", "expected"), [(256 * MiB, "100G", 256 * MiB), (GiB, "512M", 512 * MiB)])
def test_explicit_size_within_the_cap(start_engine, record_property, explicit: int, cap: str, expected: int) -> None:
    """--kv-cache-memory-bytes under a large cap is kept (min(size, cap) is
    what is checked against free memory), above the cap it is reduced."""
    import torch

    if torch.cuda.mem_get_info(0)[0] < 101 * GiB and cap == "100G":
        pytest.skip("needs a GPU with more than 101 GiB free (a 100 GiB cap must pass the fit check)")
    engine = start_engine(f"explicit-{explicit}", kv_cache_memory_bytes=explicit, kv_cache_max_memory=cap)
    result = _run_to_end(engine)
    (worker,) = result["workers"]
    per_block = worker["kv_cache_bytes"] // result["num_gpu_blocks"]
    assert expected - per_block < worker["kv_cache_bytes"] <= expected, worker
    summary(
        record_property,
        f"kv_cache_memory_bytes {explicit // MiB} MiB, cap {cap}: KV {worker['kv_cache_bytes'] / MiB:.1f} MiB",
    )


def test_max_model_len_auto_fits_the_cap(start_engine, record_property) -> None:
    """``max_model_len=-1`` (auto): vLLM fits the context length to the
    capped KV cache."""
    cap = 256 * 1024
    engine = start_engine("auto-len", max_model_len=-1, max_num_batched_tokens=8192, kv_cache_max_memory=cap)
    result = _run_to_end(engine)
    (worker,) = result["workers"]
    assert 0 < worker["kv_cache_bytes"] <= cap
    assert 0 < result["max_model_len"] <= result["num_gpu_blocks"] * result["block_size"], result
    summary(record_property, f"max_model_len auto under a 256 KiB cap: {result['max_model_len']} tokens")


def test_tensor_parallel_2_each_gpu_keeps_the_cap(start_engine, record_property) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallel 2 needs two GPUs; {torch.cuda.device_count()} visible")
    engine = start_engine(
        "tp2",
        env={"CUDA_VISIBLE_DEVICES": "0,1"},
        tensor_parallel_size=2,
        gpu_memory_utilization=0.3,
        kv_cache_max_memory=f"{CAP // MiB}M",
    )
    result = _run_to_end(engine)
    assert len(result["workers"]) == 2
    assert {w["device"] for w in result["workers"]} == {"cuda:0", "cuda:1"}
    for worker in result["workers"]:
        assert 0 < worker["kv_cache_bytes"] <= CAP
    summary(
        record_property,
        "tensor parallel 2: " + ", ".join(f"{w['kv_cache_bytes'] / MiB:.1f} MiB" for w in result["workers"]),
    )


def _run_to_end(engine) -> dict:
    engine.proc.wait(timeout=600)
    result = engine.wait_result()
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{engine.log[-4000:]}"
    return result
