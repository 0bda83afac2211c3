"""Benchmark 8b2, the autoscaler's cost per engine step with N waiting
requests, on vLLM's real scheduler: the plugin's wrapped ``EngineCore.step``
(the step, then the autoscaler's ``tick`` and the release of pages) against
vLLM's own step on the same engine core, before and after a change
of the plugin (``--baseline REV``: the package at that git revision, run in
its own process).

    .venv/bin/python benchmarks/bench_demand_steps.py [--waiting 1000 10000 20000] [--steps 200]

Real: vLLM's ``Scheduler``, ``KVCacheManager`` and ``BlockPool``, built as
vLLM's scheduler tests build them (``tests/v1/core/utils.py``) on the tiny
Llama's config; ``EngineCore.step`` as the plugin wraps it; the plugin's
``start_autoscaling``. Faked: the device. The engine core is built without
``__init__`` and its executor answers one sampled token per scheduled
request after ``--device-step-ms`` (the model's time on the device: wall
time, not this process's CPU time). N requests wait throughout: as many
arrive after each step as finished in it. The CPU time of each step is read
with ``time.process_time``; the plugin's cost is the mean of its steps less
the mean of vLLM's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import _common as c

BLOCK_SIZE = 16
NUM_BLOCKS = 129
MAX_MODEL_LEN = 128
PROMPT_TOKENS = 40
MAX_TOKENS = 4


class _Executor:
    """vLLM's executor as ``EngineCore.step`` and the plugin use it, for one worker."""

    def __init__(self, step_s: float, bytes_per_block: int) -> None:
        self.step_s = step_s
        self.bytes_per_block = bytes_per_block

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        answers = {
            "kv_cache_limit_allocated": NUM_BLOCKS * self.bytes_per_block,
            "kv_cache_limit_pages": 0,
            "kv_cache_limit_chunk_blocks": 1,
        }
        return [answers[method]]

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        import dataclasses

        from vllm.v1.outputs import ModelRunnerOutput

        time.sleep(self.step_s)  # the device's work, not this process's CPU
        req_ids = list(scheduler_output.num_scheduled_tokens)
        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        rows = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if "req_id_to_index" in fields else {}
        future: Future = Future()
        future.set_result(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids], **rows))
        return future


def _engine_core(step_s: float) -> Any:
    import queue

    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16)
    model_config = ModelConfig(model=str(c.DEFAULT_MODEL), dtype="float16", seed=42, max_model_len=MAX_MODEL_LEN)
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=32,
            max_num_batched_tokens=2048,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        ),
        model_config=model_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto"),
        parallel_config=ParallelConfig(),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    register_all_kvcache_specs(vllm_config)
    init_none_hash(sha256)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=KVCacheConfig(
            num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
        ),
        block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    core = object.__new__(EngineCore)
    core.scheduler = scheduler
    core.vllm_config = vllm_config
    core.model_executor = _Executor(step_s, spec.page_size_bytes * len(layers))
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = None
    return core


class _Arrivals:
    """Requests as vLLM's ``create_requests`` makes them, each with an id of its own."""

    def __init__(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self.params = SamplingParams(max_tokens=MAX_TOKENS)
        self.params.update_from_generation_config({}, 50256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.next = 0

    def add(self, core: Any, count: int) -> None:
        from vllm.v1.request import Request

        for _ in range(count):
            self.next += 1
            core.scheduler.add_request(
                Request(
                    request_id=str(self.next),
                    prompt_token_ids=[self.next % 1000] * PROMPT_TOKENS,
                    sampling_params=self.params,
                    pooling_params=None,
                    block_hasher=self.hasher,
                )
            )


def child(waiting: int, steps: int, step_s: float) -> dict[str, Any]:
    """One engine core with ``waiting`` requests waiting: ``steps`` steps
    of the plugin's wrapped step, then as many of vLLM's own."""
    from vllm_kv_cache_limit.hooks.runtime import autoscaler
    from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
    from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit

    core = _engine_core(step_s)
    cache_config = core.vllm_config.cache_config
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, None)
    setattr(cache_config, autoscaler.SHARED_BUDGET, None)
    start_autoscaling(core)
    scaler = EngineCoreState.of(core).autoscaler
    scaler.stop.set()  # only the steps decide
    if scaler.timer is not None:
        scaler.timer.join(timeout=5)
    reads = [0]
    read_demand = scaler.read_demand

    def counted(scheduler: Any) -> int:
        reads[0] += 1
        return read_demand(scheduler)

    scaler.read_demand = counted
    wrapped = type(core).step
    original = wrapped.__wrapped__
    arrivals = _Arrivals()
    arrivals.add(core, waiting + 32)
    for _ in range(10):  # the running batch fills
        wrapped(core)
    samples: dict[str, list[float]] = {"plugin": [], "vllm": []}
    reads[0] = 0
    for i in range(2 * steps):  # the plugin's steps, then vLLM's own: the autoscaler's ticks at its pace
        before = len(core.scheduler.requests)
        start = time.process_time()
        (wrapped if i < steps else original)(core)
        samples["plugin" if i < steps else "vllm"].append(time.process_time() - start)
        arrivals.add(core, before - len(core.scheduler.requests))
    _, now_waiting = core.scheduler.get_request_counts()
    limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool).limit
    scaler.close()
    ms = {k: [s * 1e3 for s in v] for k, v in samples.items()}
    return {
        "waiting": waiting,
        "waiting_at_end": now_waiting,
        "step_ms_plugin_mean": statistics.fmean(ms["plugin"]),
        "step_ms_vllm_mean": statistics.fmean(ms["vllm"]),
        "plugin_ms_per_step": statistics.fmean(ms["plugin"]) - statistics.fmean(ms["vllm"]),
        "step_ms_plugin_max": max(ms["plugin"]),
        "demand_reads_per_100_steps": 100 * reads[0] / steps,
        "limit_blocks": limit,
    }


def _tree_at(rev: str, into: Path) -> Path:
    """The package ``vllm_kv_cache_limit`` as it was at ``rev``, under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(c.REPO), "archive", rev, "vllm_kv_cache_limit"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_child(plugin_root: Path, waiting: int, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(plugin_root), str(c.REPO)]))
    command = [sys.executable, __file__, "--child", str(waiting), "--steps", str(args.steps)]
    command += ["--device-step-ms", str(args.device_step_ms)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(c.RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(c.RESULT_PREFIX) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, nargs="+", default=[1000, 10000, 20000])
    parser.add_argument("--steps", type=int, default=200, help="steps of each kind (plugin, vLLM's own)")
    parser.add_argument("--device-step-ms", type=float, default=20.0)
    parser.add_argument("--baseline", default="2b57bfc", help="git revision of the plugin to compare with")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(c.RESULT_PREFIX + json.dumps(child(args.child, args.steps, args.device_step_ms / 1e3)), flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        variants = {f"before ({args.baseline})": _tree_at(args.baseline, Path(tmp)), "after": c.REPO}
        for waiting in args.waiting:
            for name, root in variants.items():  # alternating, per size
                row = {"variant": name, **run_child(root, waiting, args)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    c.print_table(
        rows,
        [
            ("variant", "variant"),
            ("waiting", "waiting"),
            ("step_ms_vllm_mean", "vLLM step (ms CPU)"),
            ("step_ms_plugin_mean", "wrapped step (ms CPU)"),
            ("plugin_ms_per_step", "plugin (ms/step)"),
            ("step_ms_plugin_max", "wrapped max (ms)"),
            ("demand_reads_per_100_steps", "demand reads/100 steps"),
        ],
    )
    csv_path, json_path = c.save("demand_steps", rows, {"args": vars(args)})
    print(f"results: {csv_path}, {json_path}")


if __name__ == "__main__":
    main()
