"""One vLLM engine for a benchmark, in its own process.

    python benchmarks/_worker.py '<json>'

The JSON object holds ``LLM(...)`` keyword arguments plus an optional
``workload``: ``{"num_prompts", "prompt_len", "output_len", "repeats"}``
(token-id prompts of a fixed length, greedy, ``ignore_eos``; one short
warm-up, then ``repeats`` timed runs). Prints one line
``BENCH_RESULT {json}`` with the start-up time, what the workers measured
(KV cache bytes from the tensors' storages, resident memory, the resident
part of the KV cache buffer, device memory in use on CUDA), and per timed
run the output tokens, seconds, preemptions and queueing; on failure
``error_type`` and ``error``. Times ``*_after_launch_s`` count from
``BENCH_LAUNCH_TIME`` (set by the parent just before it starts this
process).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

from _common import RESULT_PREFIX

from tests.helpers import (
    engine_cache_settings,
    enter_engine_process,
    error_result,
    kv_cache_resident_bytes,
    print_result,
)
from vllm_kv_cache_limit.logic.kv_cache import kv_cache_storages


def _since_launch() -> float | None:
    launched = os.environ.get("BENCH_LAUNCH_TIME")
    return time.time() - float(launched) if launched else None


def _watch_startup(result: dict[str, Any]) -> Any:
    """Records, for this (first) process during ``LLM(...)``: the seconds
    spent in ``EngineArgs.create_engine_config`` (where the plugin checks a
    cap before any engine-core process starts; serial with the rest of
    start-up) and the full (generation 2) garbage collections with their
    seconds. Returns the function that stops recording."""
    import functools
    import gc

    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_engine_config"]
    config_s: list[float] = []

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            config_s.append(time.perf_counter() - start)

    full: list[float] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            full.append(time.perf_counter() - began.pop())

    EngineArgs.create_engine_config = create_engine_config
    gc.callbacks.append(on_gc)

    def stop() -> None:
        EngineArgs.create_engine_config = original
        gc.callbacks.remove(on_gc)
        result["create_engine_config_s"] = sum(config_s)
        result["parent_full_gc_count"] = len(full)
        result["parent_full_gc_s"] = sum(full)

    return stop


def worker_memory(worker: Any) -> dict[str, Any]:
    """Runs in each worker (``LLM.collective_rpc``): KV cache bytes (distinct
    storages of ``model_runner.kv_caches``), how many of those bytes are
    resident in RAM (``mincore`` over each storage), the process's resident
    memory and, on CUDA, device memory in use."""

    import psutil
    import torch

    found = kv_cache_storages(worker)
    storages = {ptr: nbytes for ptr, (nbytes, _) in found.items()}
    devices = {device for _, device in found.values()}
    out: dict[str, Any] = {
        "kv_cache_bytes": sum(storages.values()),
        "kv_devices": sorted(devices),
        "rss_bytes": psutil.Process().memory_info().rss,
        "pid": os.getpid(),
    }
    if devices == {"cpu"}:
        # Pages of the KV buffer that are resident: does allocating the cache
        # touch its memory (torch.zeros writes every page), or would RSS
        # understate it?
        out["kv_resident_bytes"] = kv_cache_resident_bytes(worker)
    if torch.cuda.is_available() and any(d.startswith("cuda") for d in devices):
        free, total = torch.cuda.mem_get_info()
        out["device_used_bytes"] = int(total - free)
        out["device_total_bytes"] = int(total)
        out["torch_reserved_bytes"] = int(torch.cuda.memory_reserved())
    return out


def _metric_values(llm: Any) -> dict[str, float]:
    """Counters and histogram sums of vLLM's Prometheus metrics (needs
    ``disable_log_stats=False``), summed over label sets."""
    values: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:
        return values
    for metric in metrics:
        kind = type(metric).__name__
        if kind == "Counter":
            values[metric.name] = values.get(metric.name, 0) + metric.value
        elif kind == "Histogram":
            values[metric.name + "_sum"] = values.get(metric.name + "_sum", 0) + metric.sum
            values[metric.name + "_count"] = values.get(metric.name + "_count", 0) + metric.count
        elif kind == "Gauge":
            values[metric.name] = metric.value
    return values


def _tree_rss() -> int:
    import psutil

    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def _tree_cpu() -> float:
    """CPU seconds (user + system) of this process and its live children:
    less sensitive than wall time to other processes on a shared machine."""
    import psutil

    me = psutil.Process()
    times = me.cpu_times()
    total = times.user + times.system
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_workload(llm: Any, workload: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then time ``repeats`` runs of the fixed workload."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    num = int(workload["num_prompts"])
    prompt_len = int(workload["prompt_len"])
    output_len = int(workload["output_len"])
    repeats = int(workload.get("repeats", 1))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(workload.get("seed", 0))
    # Token ids above the special tokens; distinct prompts, so no prefix
    # sharing between them.
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)]) for _ in range(num)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runs = []
    for _ in range(repeats):
        before = _metric_values(llm)
        cpu_before = _tree_cpu()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        cpu_s = _tree_cpu() - cpu_before
        after = _metric_values(llm)
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        queue = [
            m.scheduled_ts - m.queued_ts
            for o in outputs
            if (m := o.metrics) is not None and m.scheduled_ts and m.queued_ts
        ]
        per_req_preempt = [o.metrics.num_preemptions for o in outputs if o.metrics is not None]

        def delta(name: str, after: dict = after, before: dict = before) -> float | None:
            if name not in after:
                return None
            return after[name] - before.get(name, 0)

        runs.append(
            {
                "seconds": seconds,
                "output_tokens": out_tokens,
                "output_tokens_per_s": out_tokens / seconds,
                "cpu_s": cpu_s,
                "output_tokens_per_cpu_s": out_tokens / cpu_s if cpu_s > 0 else None,
                "preemptions": delta("vllm:num_preemptions"),
                "preempted_requests": sum(1 for p in per_req_preempt if p) if per_req_preempt else None,
                "preemptions_from_requests": sum(per_req_preempt) if per_req_preempt else None,
                "queue_s_mean": statistics.fmean(queue) if queue else None,
                "queue_s_max": max(queue) if queue else None,
                "queue_s_sum_metric": delta("vllm:request_queue_time_seconds_sum"),
                "ttft_s_sum_metric": delta("vllm:time_to_first_token_seconds_sum"),
            }
        )
    return {"runs": runs, "tree_rss_bytes_after": _tree_rss()}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    enter_engine_process()
    spec = dict(spec)
    workload = spec.pop("workload", None)
    result: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    llm_started = None
    try:
        from vllm import LLM

        result["import_s"] = time.perf_counter() - started
        stop_watching = _watch_startup(result)
        llm_started = time.perf_counter()
        try:
            llm = LLM(**spec)
        finally:
            stop_watching()
        result["startup_s"] = time.perf_counter() - llm_started
        result["ready_after_launch_s"] = _since_launch()
        result["startup_cpu_s"] = _tree_cpu()
        # vLLM modules this (first) process loaded: shows imports that an
        # engine argument or a hook pulls into the front-end process.
        result["parent_modules"] = len(sys.modules)
        result["parent_worker_modules"] = sorted(m for m in sys.modules if m.startswith("vllm.v1.worker."))
        result["workers"] = llm.collective_rpc(worker_memory)
        result["kv_cache_bytes"] = [w["kv_cache_bytes"] for w in result["workers"]]
        result.update(engine_cache_settings(llm))
        result["tree_rss_bytes"] = _tree_rss()
        if workload:
            result["workload"] = run_workload(llm, workload)
        result["ok"] = True
    except Exception as exc:  # reported, not raised: the parent reads the line
        result["error_after_launch_s"] = _since_launch()
        if llm_started is not None:
            result["error_in_llm_s"] = time.perf_counter() - llm_started
        result.update(error_result(exc))
    return result


def main() -> None:
    print_result(run(json.loads(sys.argv[1])), RESULT_PREFIX)


if __name__ == "__main__":
    main()
