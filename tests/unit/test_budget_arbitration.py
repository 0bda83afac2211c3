"""The shared budget's arbitration on vLLM's real scheduler: two engine
cores under one budget, one with a steady stream of long requests, the
other bursting with many waiting requests. The bursting one must reach its
even share of the budget within a bounded number of decisions, and the
steady one keep its even share while it has demand.

Real: vLLM's ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` (vLLM's
CPU build, as vLLM's own scheduler tests build them), ``EngineCore.step``
as the plugin wraps it, the plugin's run-time limit, autoscaler and ledger
files (a private lock folder). Faked: the model (one sampled token per
scheduled request, as vLLM's scheduler tests do) and the clock (each step
is 0.1 s, one decision each: no sleeps).
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit import register  # noqa: E402

register()  # the hooks on vLLM's block pool and engine core

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.engine.core import EngineCore  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from vllm_kv_cache_limit.hooks.runtime import shared_budget, utility_methods  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.limit import RuntimeLimit  # noqa: E402
from vllm_kv_cache_limit.logic.autoscale_policy import Hysteresis, Policy  # noqa: E402

BLOCK_SIZE = 64
"""Large blocks: a request of 10 prompt tokens and 50 to generate holds one
block from its first step to its last, so it frees it only when it finishes."""
MAX_MODEL_LEN = 256
"""4 blocks: the floor is 5 (one request of max_model_len and the null block)."""
NUM_BLOCKS = 32
"""Each instance's allocation, vLLM's null block included: its ceiling."""
BUDGET_BLOCKS = 32
"""The budget, in blocks of either instance: the even share is 16."""
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32)
BPB = SPEC.page_size_bytes
STEP_S = 0.1
"""Seconds of the test's clock per step: each step is followed by a decision."""
STEADY_TOKENS = 50
BURST_TOKENS = 4
_ROWS_BY_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


class _Workers:
    """vLLM's executor as the engine core uses it: the KV cache's bytes, no
    pages returned, one sampled token per scheduled request."""

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        answers = {"kv_cache_limit_allocated": NUM_BLOCKS * BPB, "kv_cache_limit_pages": 0}
        answers["kv_cache_limit_hold_entries"] = 0  # no worker process: the entries go with the engine core
        if method not in answers:
            raise AssertionError(f"the plugin made an unexpected worker call: {method}{args}")
        return [answers[method]]

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        rows = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _ROWS_BY_INDEX else {}
        output: Future = Future()
        output.set_result(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids], **rows))
        return output


def _engine_core(model: str) -> EngineCore:
    """vLLM's ``EngineCore`` (built without ``__init__``) around vLLM's scheduler."""
    model_config = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)
    scheduler_config = SchedulerConfig(
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, cache_dtype="auto")
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)]
    )
    cache_config.num_gpu_blocks = NUM_BLOCKS
    register_all_kvcache_specs(vllm_config)
    init_none_hash(sha256)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=BLOCK_SIZE,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    core = object.__new__(EngineCore)
    core.scheduler = scheduler
    core.vllm_config = vllm_config
    core.model_executor = _Workers()
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = None
    return core


@dataclasses.dataclass
class Instance:
    """One engine core with its autoscaler, decided by the test's clock."""

    core: EngineCore
    scaler: Autoscaler
    added: int = 0

    @property
    def limit(self) -> int:
        limit = RuntimeLimit.of(self.core.scheduler.kv_cache_manager.block_pool)
        assert limit is not None
        return limit.limit

    def add(self, count: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, 1)
        for _ in range(count):
            self.added += 1
            self.core.scheduler.add_request(
                Request(
                    request_id=str(self.added),
                    prompt_token_ids=[self.added % 400 + 3] * 10,
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
                )
            )

    def step(self, now: float) -> None:
        """One step of vLLM's engine core (if it has requests), then a decision at ``now``."""
        if self.core.scheduler.has_requests():
            self.core.step()
        limit = RuntimeLimit.of(self.core.scheduler.kv_cache_manager.block_pool)
        self.scaler.tick(self.core, limit, now)

    @property
    def waiting(self) -> int:
        return len(self.core.scheduler.waiting)


def _instance(model: str, folder: Path) -> Instance:
    """An autoscaled engine core in the budget's ledger, at its floor, as
    ``start_autoscaling`` starts one (its decisions are the test's)."""
    core = _engine_core(model)
    allocation = utility_methods.allocation_of(core)
    floor = allocation.blocks_per_request + 1
    scaler = Autoscaler(
        allocation=allocation,
        hysteresis=Hysteresis(Policy(floor, allocation.blocks_per_request, shrink_after_s=30.0)),
        ceiling=allocation.num_blocks,
        set_limit=functools.partial(utility_methods.set_limit, log=False),
        group_caps=[(BLOCK_SIZE, MAX_MODEL_LEN // BLOCK_SIZE)],
        max_model_len=MAX_MODEL_LEN,
        budget=BUDGET_BLOCKS * BPB,
        device_bytes_per_block=BPB,
    )
    shared_budget.join(scaler, [("cpu-node0", "host memory node 0")], str(folder))
    utility_methods.set_limit(core, floor * BPB, "drain", log=False)
    scaler.held = floor
    return Instance(core, scaler)


@pytest.fixture
def pair(tiny_model: str, tmp_path: Path) -> Iterator[tuple[Instance, Instance]]:
    steady, bursting = _instance(tiny_model, tmp_path), _instance(tiny_model, tmp_path)
    yield steady, bursting
    steady.scaler.close()
    bursting.scaler.close()


BOUND_STEPS = 20
"""Decisions (2 s of the clock) within which the bursting instance must
reach its even share: fewer than the steady instance's requests take to
finish (50 steps), so a drain that waits for them does not."""


def test_a_bursting_instance_reaches_its_even_share_within_a_bounded_number_of_steps(
    pair: tuple[Instance, Instance],
) -> None:
    steady, bursting = pair
    even = BUDGET_BLOCKS // 2
    now = 100.0

    # The steady instance: two requests a step, each 50 tokens long, more than its blocks hold.
    def both_step() -> None:
        nonlocal now
        now += STEP_S
        steady.add(2, STEADY_TOKENS)
        steady.step(now)
        bursting.step(now)
        holds = steady.scaler.held + bursting.scaler.held
        assert holds <= BUDGET_BLOCKS, (steady.scaler.held, bursting.scaler.held)

    for _ in range(60):
        both_step()
    # Premise: the steady instance holds all the budget but the other's floor, and has requests waiting.
    floor = bursting.scaler.floor
    assert (steady.limit, bursting.limit) == (BUDGET_BLOCKS - floor, floor)
    assert steady.waiting > 0 and steady.scaler.wants == NUM_BLOCKS

    bursting.add(60, BURST_TOKENS)  # a burst: most of it waits
    reached = None
    for step in range(1, BOUND_STEPS + 1):
        both_step()
        if reached is None and bursting.limit >= even:
            reached = step
        if reached is not None:
            # The steady one keeps its even share: it has demand.
            assert steady.limit >= even, (step, steady.limit)
    assert bursting.waiting > 0  # it still had requests waiting: the share was needed
    assert reached is not None, (
        f"the bursting instance is at {bursting.limit} blocks after {BOUND_STEPS} steps (its even share is "
        f"{even}); the steady one at {steady.limit}, holding {steady.scaler.held}"
    )


CHURN_STEPS = 150
"""Decisions (15 s of the clock) over which the limits' changes are counted."""
WAVE_STEPS = 8
"""The steady instance's arrivals: a few short requests every so many steps, so
its demand falls to nothing between two waves (as a conversation server's does
between requests)."""


def test_a_steady_instance_whose_demand_dips_does_not_move_the_limits_at_every_wave(
    pair: tuple[Instance, Instance],
) -> None:
    steady, bursting = pair
    now = 100.0
    demands: list[int] = []

    def both_step(step: int) -> None:
        nonlocal now
        now += STEP_S
        if step % WAVE_STEPS == 0:
            steady.add(3, BURST_TOKENS)
        if bursting.waiting < 20:
            bursting.add(20, STEADY_TOKENS)  # always more than it can hold: it wants the whole budget
        steady.step(now)
        bursting.step(now)
        demands.append(steady.scaler.demand)
        assert steady.scaler.held + bursting.scaler.held <= BUDGET_BLOCKS

    for step in range(60):  # both reach their shares
        both_step(step)
    before = (steady.scaler.changes, bursting.scaler.changes)
    for step in range(60, 60 + CHURN_STEPS):
        both_step(step)
    changes = (steady.scaler.changes - before[0], bursting.scaler.changes - before[1])
    waves = CHURN_STEPS // WAVE_STEPS
    # Premise: the steady instance's demand came and went at every wave.
    assert min(demands[60:]) == 0 and max(demands[60:]) > 0
    assert bursting.waiting > 0
    # A wave's requests fit in what the steady instance keeps; its share
    # must not be taken and given back at each of them.
    assert sum(changes) <= 4, (
        f"{sum(changes)} limit changes (steady {changes[0]}, bursting {changes[1]}) in {CHURN_STEPS} decisions "
        f"over {waves} waves of the steady instance's requests"
    )
