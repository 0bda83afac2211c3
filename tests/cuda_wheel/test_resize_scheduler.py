"""Run-time resize and autoscaling on vLLM's real scheduler (0.29-0.34): requests
added, scheduled, finished, aborted and preempted by vLLM's own
``Scheduler``, ``KVCacheManager`` and ``BlockPool`` (with the plugin's
hooks on the block pool) while the limit is lowered, raised and autoscaled.

Real: the scheduler, built as vLLM's own scheduler tests build it
(``tests/v1/core/utils.py``: ``create_scheduler``, ``create_requests``) on a
config of the repository's tiny Llama and a small ``KVCacheConfig`` (one
full-attention group, 41 blocks of 16 tokens, no model runner); vLLM's
``EngineCore.step`` and ``abort_requests``, as the plugin wraps them; the
plugin's ``kv_cache_limit_set`` and ``kv_cache_limit_status``, as it
installs them on ``EngineCore``, and its ``start_autoscaling``.

Faked: the workers and the device. The engine core is vLLM's ``EngineCore``
built without ``__init__`` (no processes, no model), and its executor answers
what the workers would: ``execute_model`` with a ``ModelRunnerOutput`` built by
hand, one sampled token per scheduled request, as vLLM's scheduler tests do;
``collective_rpc`` to the plugin's worker methods as a CUDA worker answers
them (the bytes of its KV cache; no pages returned to the OS: on CUDA the
limit is logical).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tests.cuda_wheel.conftest import FakeGPU
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit
from vllm_kv_cache_limit.logic import limit_math

BLOCK_SIZE = 16
NUM_BLOCKS = 41
"""Allocated blocks, vLLM's null block (0) included: 40 for requests."""
MAX_MODEL_LEN = 128
"""8 blocks: the least limit is 9 blocks (one request of max_model_len and the null block)."""
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16)
"""The tiny Llama's attention (2 KV heads of 64, float16): 8 KiB per layer and block."""
BYTES_PER_BLOCK = SPEC.page_size_bytes * len(LAYERS)
PROMPT_TOKENS = 40
MAX_TOKENS = 4
"""40 + 4 tokens: 3 blocks from the first step to the last, so that blocks
are taken only when a request is scheduled from the waiting queue."""
EOS_TOKEN_ID = 50256
SAMPLED_TOKEN_ID = 7
_ROWS_BY_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
"""Whether this vLLM's ``ModelRunnerOutput`` has ``req_id_to_index`` (0.29-0.33)."""
LIMIT = 11
"""The lowered limit: blocks 1-10 usable. Six requests of 3 blocks hold 1-18;
request 3 holds 10-12, across it."""


class _Workers:
    """vLLM's executor as the engine core uses it, answering for one CUDA
    worker; the plugin's calls are recorded."""

    def __init__(self) -> None:
        self.rpcs: list[tuple[str, tuple[Any, ...]]] = []

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> list[int]:
        self.rpcs.append((method, tuple(args)))
        if method == "kv_cache_limit_allocated":  # the distinct storages of its KV cache tensors
            return [NUM_BLOCKS * BYTES_PER_BLOCK]
        if method == "kv_cache_limit_pages":  # CUDA memory is limited logically, not returned
            return [0]
        if method == "kv_cache_limit_chunk_blocks":  # vLLM 0.34's extensible cache, not mapped in chunks
            return [1]
        if method == "kv_cache_limit_committable":  # nothing committed for a limit: no bound
            return [-1]
        if method == "kv_cache_limit_hold_entries":  # no worker process: the entries go with the engine core
            return [0]
        raise AssertionError(f"the plugin made an unexpected worker call: {method}{args}")

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Future:
        """One sampled token per scheduled request (every prompt here fits in one step)."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        # vLLM 0.29-0.33's output also maps each request to its row (0.34 reads the row from req_ids).
        rows = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _ROWS_BY_INDEX else {}
        output: Future = Future()
        output.set_result(
            ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[SAMPLED_TOKEN_ID] for _ in req_ids], **rows)
        )
        return output

    def releases(self) -> list[tuple[Any, ...]]:
        """The ``(keep, num_blocks, release, lazy)`` of each page call the plugin made."""
        return [args for method, args in self.rpcs if method == "kv_cache_limit_pages"]


def _scheduler(model: str, prefix_caching: bool = False) -> Scheduler:
    """vLLM's scheduler as ``create_scheduler`` builds it (vLLM's
    ``tests/v1/core/utils.py``), over the tiny Llama's config."""
    model_config = ModelConfig(model=model, dtype="float16", seed=42, max_model_len=MAX_MODEL_LEN)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        watermark=0.0,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=prefix_caching,
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)]
    )
    cache_config.num_gpu_blocks = NUM_BLOCKS
    register_all_kvcache_specs(vllm_config)
    init_none_hash(sha256)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def _engine_core(scheduler: Scheduler) -> EngineCore:
    """vLLM's ``EngineCore`` around ``scheduler``, built without ``__init__``:
    what its ``step`` and the plugin's methods read."""
    core = object.__new__(EngineCore)
    core.scheduler = scheduler
    core.vllm_config = scheduler.vllm_config
    core.model_executor = _Workers()
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = None
    return core


def _add(
    core: EngineCore, ids: list[str], max_tokens: int = MAX_TOKENS, prompt: list[int] | None = None
) -> list[Request]:
    """Requests as ``create_requests`` makes them, added to the scheduler:
    request ``i``'s prompt is ``PROMPT_TOKENS`` tokens ``i`` unless given."""
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    requests = [
        Request(
            request_id=req_id,
            prompt_token_ids=[int(req_id)] * PROMPT_TOKENS if prompt is None else list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        for req_id in ids
    ]
    for request in requests:
        core.scheduler.add_request(request)
    return requests


def _pool(core: EngineCore) -> BlockPool:
    return core.scheduler.kv_cache_manager.block_pool


def _limit(core: EngineCore) -> RuntimeLimit:
    limit = RuntimeLimit.of(_pool(core))
    assert limit is not None
    return limit


def _blocks(core: EngineCore) -> dict[str, list[int]]:
    """The block ids each unfinished request holds."""
    manager = core.scheduler.kv_cache_manager
    return {req_id: manager.get_blocks(req_id).get_block_ids()[0] for req_id in core.scheduler.requests}


def _free_ids(core: EngineCore) -> list[int]:
    """The ids of the blocks in the free queue, the scheduler's to hand out."""
    return [block.block_id for block in _pool(core).free_block_queue.get_all_free_blocks()]


def _run(core: EngineCore, after_step: Callable[[], None] = lambda: None, steps: int = 30) -> None:
    """Step the engine core until every request has finished; ``after_step``
    checks each step."""
    for _ in range(steps):
        core.step()
        after_step()
        if not core.scheduler.has_requests():
            return
    raise AssertionError(f"requests left after {steps} steps: {_blocks(core)}")


def _below(core: EngineCore, limit: int) -> Callable[[], None]:
    """A check that the free queue offers no block at or above ``limit``, and
    that no request holds one it did not hold when the check was made (a
    drain leaves requests their blocks above the limit until they finish)."""
    before = _blocks(core)

    def check() -> None:
        handed = {
            req_id: above
            for req_id, ids in _blocks(core).items()
            if (above := [b for b in ids if b >= limit and b not in before.get(req_id, [])])
        }
        assert not handed, f"blocks at or above the limit {limit} handed out: {handed}"
        assert max(_free_ids(core), default=0) < limit

    return check


def _started(core: EngineCore, count: int = 6, longer: int | None = None) -> list[Request]:
    """``count`` requests running after one step, request ``i`` on blocks
    ``3i+1`` to ``3i+3``; request ``longer`` (if any) asks for 12 tokens."""
    requests = [_add(core, [str(i)], max_tokens=12 if i == longer else MAX_TOKENS)[0] for i in range(count)]
    core.step()
    assert _blocks(core) == {str(i): [3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(count)}
    assert all(r.status == RequestStatus.RUNNING for r in requests)
    return requests


def _set(core: EngineCore, blocks: int, mode: str) -> dict[str, Any]:
    status = core.kv_cache_limit_set(blocks * BYTES_PER_BLOCK, mode)
    assert not limit_math.is_error(status), status
    assert status["num_blocks_limit"] == blocks and status["mode"] == mode
    return status


PREFIX_CACHING = pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])


@PREFIX_CACHING
def test_preempt_mode_preempts_exactly_the_requests_holding_blocks_above_the_limit(
    fake_gpu: FakeGPU, tiny_model: str, prefix_caching: bool
) -> None:
    """Requests 3-5 hold blocks at or above 11 (request 3 across it): they
    are preempted back to the waiting queue, 0-2 run on; the free queue holds
    only block 10 (request 3's, below the limit), usage is relative to the
    limit, and every block handed out until all finish is below it."""
    core = _engine_core(_scheduler(tiny_model, prefix_caching))
    scheduler = core.scheduler
    requests = _started(core)

    status = _set(core, LIMIT, "preempt")

    assert [r.request_id for r in scheduler.running] == ["0", "1", "2"]
    assert [r.request_id for r in scheduler.waiting] == ["3", "4", "5"]
    assert [r.request_id for r in requests if r.status == RequestStatus.PREEMPTED] == ["3", "4", "5"]
    assert [r.num_preemptions for r in requests] == [0, 0, 0, 1, 1, 1]
    assert sorted(_limit(core).withheld) == list(range(LIMIT, NUM_BLOCKS))
    assert _free_ids(core) == [10]
    assert _pool(core).get_num_free_blocks() == 1
    assert _pool(core).get_usage() == pytest.approx(1 - 1 / (LIMIT - 1))
    assert status["num_blocks_in_use"] == 9 and status["num_blocks_in_use_above_limit"] == 0 and status["holds"]
    # Nothing above the limit in use: the workers are asked for its pages at once.
    assert core.model_executor.releases() == [(LIMIT, NUM_BLOCKS, True, False)]

    _run(core, _below(core, LIMIT))

    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert all(r.num_output_tokens == MAX_TOKENS for r in requests)
    assert sorted(_free_ids(core)) == list(range(1, LIMIT))
    assert core.kv_cache_limit_status()["num_blocks_in_use"] == 0


@PREFIX_CACHING
def test_drain_mode_preempts_nothing_and_withholds_blocks_above_the_limit_as_they_are_freed(
    fake_gpu: FakeGPU, tiny_model: str, prefix_caching: bool
) -> None:
    """The same six requests under a drain to 11: all run on; the free queue
    is empty (19-40 withheld at once); an aborted request's blocks 16-18 are
    withheld, not queued, and a new request with its prompt waits, never
    finding them in the prefix cache; once all finish the limit holds, the
    workers are asked for the pages above it, and the new request runs on
    blocks below it."""
    core = _engine_core(_scheduler(tiny_model, prefix_caching))
    scheduler = core.scheduler
    requests = _started(core)

    status = _set(core, LIMIT, "drain")

    assert [r.request_id for r in scheduler.running] == ["0", "1", "2", "3", "4", "5"]
    assert all(r.num_preemptions == 0 for r in requests)
    assert sorted(_limit(core).withheld) == list(range(19, NUM_BLOCKS))
    assert _free_ids(core) == []
    assert status["num_blocks_in_use"] == 18 and status["num_blocks_in_use_above_limit"] == 8
    assert not status["holds"]

    (late,) = _add(core, ["6"], prompt=[5] * PROMPT_TOKENS)  # request 5's: its blocks, were they cached
    core.abort_requests(["5"])
    assert requests[5].status == RequestStatus.FINISHED_ABORTED
    assert sorted(_limit(core).withheld) == list(range(16, NUM_BLOCKS))
    assert _free_ids(core) == []
    assert core.model_executor.releases() == []

    below = _below(core, LIMIT)

    def check() -> None:
        below()
        assert all(r.num_preemptions == 0 for r in requests)
        if scheduler.requests.get("3") is not None:  # blocks 11-15 still in use
            assert core.model_executor.releases() == []
            assert late.status == RequestStatus.WAITING

    _run(core, check)

    assert [r.status for r in requests[:5]] == [RequestStatus.FINISHED_LENGTH_CAPPED] * 5
    assert late.status == RequestStatus.FINISHED_LENGTH_CAPPED and late.num_output_tokens == MAX_TOKENS
    assert core.model_executor.releases() == [(LIMIT, NUM_BLOCKS, True, False)]
    status = core.kv_cache_limit_status()
    assert status["holds"] and status["num_blocks_in_use"] == 0
    assert sorted(_limit(core).withheld) == list(range(LIMIT, NUM_BLOCKS))


FILLED_LIMIT = 12
"""A limit across request 3's last block: 10 and 11 full below it, 12
partly filled at or above it (tokens 32-40), not yet in the prefix cache."""


def _drain_while_a_block_above_fills(core: EngineCore) -> Request:
    """Prefix caching on, a drain to 12, and request 3 (12 tokens to
    generate) stepped until its block 12 is full: vLLM's scheduler caches a
    block as it fills, here above the limit after the drain began (what
    ``RuntimeLimit.shrink`` evicted was cached before). Request 3, still running."""
    requests = _started(core, longer=3)
    _set(core, FILLED_LIMIT, "drain")
    filler = requests[3]
    pool = _pool(core)
    assert pool.blocks[FILLED_LIMIT].block_hash is None
    while filler.num_computed_tokens < 3 * BLOCK_SIZE:
        core.step()
    assert _blocks(core)["3"][:3] == [10, 11, FILLED_LIMIT] and filler.status == RequestStatus.RUNNING
    return filler


def _sharing(filler: Request) -> list[int]:
    """A prompt that shares the filler's first three blocks (48 tokens)."""
    return list(filler.all_token_ids[: 3 * BLOCK_SIZE]) + [9] * 4


def test_a_block_cached_above_the_limit_leaves_the_prefix_cache_when_its_request_finishes(
    fake_gpu: FakeGPU, tiny_model: str
) -> None:
    """Request 3's block 12, cached after the drain to 12 began, is withheld
    and leaves the prefix cache once request 3 finishes: a request sharing
    its 48 tokens hits blocks 10 and 11 only, and runs below the limit."""
    core = _engine_core(_scheduler(tiny_model, prefix_caching=True))
    filler = _drain_while_a_block_above_fills(core)
    _run(core)
    assert filler.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert FILLED_LIMIT in _limit(core).withheld
    assert _pool(core).blocks[FILLED_LIMIT].block_hash is None

    (sharer,) = _add(core, ["9"], prompt=_sharing(filler))
    core.step()

    assert _blocks(core)["9"][:2] == [10, 11]
    _run(core, _below(core, FILLED_LIMIT))
    assert sharer.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert core.kv_cache_limit_status()["holds"]


def test_drain_mode_gives_a_new_request_no_block_above_the_limit_through_the_prefix_cache(
    fake_gpu: FakeGPU, tiny_model: str
) -> None:
    """While request 3 still runs on block 12 (cached above the limit after
    the drain began), a new request sharing its 48 tokens is scheduled: it
    must not be handed block 12 by a prefix-cache hit, or the drain waits
    for it too (and for every later request sharing that prefix)."""
    core = _engine_core(_scheduler(tiny_model, prefix_caching=True))
    filler = _drain_while_a_block_above_fills(core)

    (sharer,) = _add(core, ["9"], prompt=_sharing(filler))
    core.step()

    assert sharer.status == RequestStatus.RUNNING
    assert max(_blocks(core)["9"]) < FILLED_LIMIT, _blocks(core)


def test_raising_the_limit_gives_the_withheld_blocks_back(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """After a preempting shrink to 11, the limit raised to the whole
    allocation: blocks 11-40 are in the free queue again, the preempted
    requests are scheduled at once on blocks above the old limit, and all
    40 blocks are free once every request finishes."""
    core = _engine_core(_scheduler(tiny_model))
    scheduler = core.scheduler
    requests = _started(core)
    _set(core, LIMIT, "preempt")
    assert _pool(core).get_num_free_blocks() == 1

    status = _set(core, NUM_BLOCKS, "drain")

    assert _limit(core).withheld == set()
    assert sorted(_free_ids(core)) == list(range(10, NUM_BLOCKS))
    assert _pool(core).get_num_free_blocks() == NUM_BLOCKS - 1 - 9
    assert status["num_blocks_in_use"] == 9 and status["holds"]
    # The workers are told the pages above the old limit are in use again.
    assert core.model_executor.releases()[-1][2] is False

    core.step()

    assert [r.request_id for r in scheduler.running] == ["0", "1", "2", "3", "4", "5"]
    held = _blocks(core)
    assert max(b for req_id in ("3", "4", "5") for b in held[req_id]) >= LIMIT
    _run(core)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert _pool(core).get_num_free_blocks() == NUM_BLOCKS - 1
    assert _pool(core).get_usage() == 0


@pytest.fixture
def autoscaled(fake_gpu: FakeGPU, tiny_model: str) -> Iterator[EngineCore]:
    """An engine core started with ``--kv-cache-autoscale`` (no shared
    budget) through the plugin's ``start_autoscaling``; its
    in-process timer stopped, so that only the test's steps decide."""
    core = _engine_core(_scheduler(tiny_model))
    cache_config = core.vllm_config.cache_config
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, None)
    setattr(cache_config, autoscaler.SHARED_BUDGET, None)
    start_autoscaling(core)
    scaler = EngineCoreState.of(core).autoscaler
    assert isinstance(scaler, Autoscaler)
    scaler.stop.set()
    assert scaler.timer is not None
    scaler.timer.join(timeout=5)
    yield core
    scaler.close()


def _demand(request: Request) -> int:
    """Blocks ``request`` holds and will need to finish: its prompt and
    ``max_tokens`` (at least one more token), at most ``max_model_len``."""
    tokens = min(MAX_MODEL_LEN, max(request.num_tokens + 1, request.num_prompt_tokens + request.max_tokens))
    return min(MAX_MODEL_LEN // BLOCK_SIZE, -(-tokens // BLOCK_SIZE))


def test_the_autoscalers_demand_counts_the_waiting_and_running_requests(autoscaled: EngineCore) -> None:
    """At the floor (9 blocks), five requests of 3 blocks and one capped at
    max_model_len (8): the demand counts the waiting ones before any step,
    waiting and running ones after the step that could run only two of them
    (the limit then grows to hold them all), and no finished one."""
    core = autoscaled
    scheduler = core.scheduler
    scaler = EngineCoreState.of(core).autoscaler
    assert isinstance(scaler, Autoscaler)
    floor = MAX_MODEL_LEN // BLOCK_SIZE + 1
    assert _limit(core).limit == floor and scaler.floor == floor
    assert core.kv_cache_limit_status()["autoscale"]["floor_bytes"] == floor * BYTES_PER_BLOCK

    requests = _add(core, ["0", "1", "2", "3", "4"]) + _add(core, ["5"], max_tokens=1000)
    assert [_demand(r) for r in requests] == [3, 3, 3, 3, 3, 8]
    assert scaler.read_demand(scheduler) == 23

    core.step()  # 8 usable blocks: requests 0 and 1 run, then the autoscaler decides

    assert [r.request_id for r in scheduler.running] == ["0", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2", "3", "4", "5"]
    assert scheduler.get_request_counts() == (2, 4)
    assert scaler.demand == scaler.read_demand(scheduler) == sum(_demand(r) for r in requests) == 23
    assert _limit(core).limit == 23 + 8 + 1  # the demand, headroom (one request), the null block
    assert scaler.changes == 1

    core.step()  # the rest are scheduled under the grown limit
    assert scheduler.get_request_counts() == (6, 0)
    core.abort_requests(["5"])
    assert scaler.read_demand(scheduler) == 15
    _run(core)
    assert scaler.read_demand(scheduler) == 0
