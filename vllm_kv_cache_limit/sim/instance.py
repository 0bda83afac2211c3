"""One simulated vLLM instance: vLLM's real ``EngineCore.step`` over its real
``Scheduler``, ``KVCacheManager`` and ``BlockPool`` (built as vLLM's own
scheduler tests build them, ``tests/v1/core/utils.py``), with the plugin's
hooks on them. Only the executor is replaced (:class:`SimExecutor`): it
answers each scheduled batch with one sampled token per request that
decodes or ends its prefill, and advances the virtual clock by the batch's
step time.
"""

from __future__ import annotations

import dataclasses
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_kv_cache_limit import register

register()  # the plugin's hooks on vLLM's block pool and engine core, before they load

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

from vllm_kv_cache_limit.hooks.runtime import engine_core as engine_core_hooks  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime import utility_methods  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.autoscaler import TICK_S  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime.limit import RuntimeLimit  # noqa: E402
from vllm_kv_cache_limit.logic import limit_math  # noqa: E402
from vllm_kv_cache_limit.logic.sizes import format_size  # noqa: E402
from vllm_kv_cache_limit.sim.aiconfigurator import model_folder  # noqa: E402
from vllm_kv_cache_limit.sim.clock import VirtualClock  # noqa: E402
from vllm_kv_cache_limit.sim.step_time import Batch, StepTimeModel  # noqa: E402
from vllm_kv_cache_limit.sim.traffic import Arrival  # noqa: E402

_ROWS_BY_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
"""Whether this vLLM's ``ModelRunnerOutput`` maps each request to its row (0.29-0.33; 0.34 reads ``req_ids``)."""
SAMPLED_TOKEN_ID = 7
EOS_TOKEN_ID = 2
SAMPLE_S = 0.1
"""Seconds of the virtual clock between two points of an instance's timeline."""
EMPTY_STEP_S = 0.1
"""Seconds an instance with requests but nothing it can schedule waits at
most before it tries again (the autoscaler's decision interval): a real
engine core steps again at once, but its steps change nothing until its
autoscaler's next decision, and take no device time. It tries again at that
decision, or at once when the decision after its empty step grew its limit."""
RETRY_MIN_S = 0.001
"""The least wait before such a retry (a decision that failed leaves no later one due)."""


@dataclass(frozen=True)
class InstanceSpec:
    """What one simulated instance serves and how it is configured."""

    name: str
    model: str
    """A local model folder (its ``config.json`` is enough): vLLM reads the KV
    cache's shape from it; or a Hugging Face name aiconfigurator-core ships a
    config for (``Qwen/Qwen3-8B``), made such a folder."""
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    dtype: str = "auto"


class SimulationError(ValueError):
    """A simulated instance that vLLM or the plugin would refuse to start; the message says what would work."""


def build_engine_core(spec: InstanceSpec, cap_bytes: int, executor: SimExecutor) -> EngineCore:
    """vLLM's ``EngineCore`` (built without ``__init__``: no processes, no
    model) around vLLM's scheduler over the whole blocks of the model's real
    KV cache shape that fit in ``cap_bytes`` (vLLM's null block included),
    as a capped instance allocates them."""
    # No tokenizer: the simulated tokens are not the model's, and a folder
    # holding only the model's config.json is enough for the KV cache's shape.
    model_config = ModelConfig(
        model=model_folder(spec.model) or spec.model,
        dtype=spec.dtype,
        seed=0,
        max_model_len=spec.max_model_len,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=max(spec.max_num_batched_tokens, spec.max_model_len),
        max_model_len=spec.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        watermark=0.0,
    )
    cache_config = CacheConfig(
        block_size=spec.block_size, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=False
    )
    parallel_config = ParallelConfig()
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
    )
    attention = FullAttentionSpec(
        block_size=spec.block_size,
        num_kv_heads=model_config.get_num_kv_heads(parallel_config),
        head_size=model_config.get_head_size(),
        dtype=model_config.dtype,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model_config.get_num_layers(parallel_config))]
    bytes_per_block = attention.page_size_bytes * len(layers)
    num_blocks = cap_bytes // bytes_per_block
    least = -(-spec.max_model_len // spec.block_size) + limit_math.NULL_BLOCKS
    if num_blocks < least:
        raise SimulationError(
            f"instance {spec.name}: {format_size(cap_bytes)} ({cap_bytes} bytes) holds {num_blocks} KV cache blocks "
            f"of {format_size(bytes_per_block)}, fewer than one request of max_model_len {spec.max_model_len} needs "
            f"with vLLM's null block ({least}); give it at least {format_size(least * bytes_per_block)} or a "
            "shorter max_model_len."
        )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, attention)]
    )
    cache_config.num_gpu_blocks = num_blocks
    executor.bytes_per_block = bytes_per_block
    executor.num_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    init_none_hash(sha256)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=spec.block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    executor.scheduler = scheduler
    core = object.__new__(EngineCore)
    core.scheduler = scheduler
    core.vllm_config = vllm_config
    core.model_executor = executor
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = None
    return core


@dataclass
class SimExecutor:
    """vLLM's executor as the engine core uses it: the model replaced by the
    step-time model, the device's memory by what a worker would answer (the
    bytes of its KV cache; no pages returned: the limit is logical, as on CUDA)."""

    clock: VirtualClock
    step_time: StepTimeModel
    scheduler: Any = None
    """vLLM's scheduler whose batches it runs (its requests are read as a batch is run)."""
    bytes_per_block: int = 0
    num_blocks: int = 0
    started_at: float = 0.0
    last: Batch = field(default_factory=Batch)

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> list[int]:
        answers = {
            "kv_cache_limit_allocated": self.num_blocks * self.bytes_per_block,
            "kv_cache_limit_pages": 0,
            "kv_cache_limit_chunk_blocks": 1,
            "kv_cache_limit_committable": -1,
            "kv_cache_limit_hold_entries": 0,  # no worker process: the entries go with the engine core
        }
        if method not in answers:
            raise NotImplementedError(f"the simulated executor has no answer for {method}{args}")
        return [answers[method]]

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future:
        """The batch timed and its tokens sampled; the clock moves to the step's end."""
        requests = self.scheduler.requests
        req_ids, sampled = [], []
        decode = prefill = prefill_requests = context = 0
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            computed_after = request.num_computed_tokens  # vLLM counts the scheduled tokens as computed at once
            before = computed_after - count
            if before >= request.num_tokens - 1:
                decode += 1
                context += computed_after
            else:
                prefill += count
                prefill_requests += 1
            req_ids.append(req_id)
            sampled.append([SAMPLED_TOKEN_ID] if computed_after >= request.num_tokens else [])
        self.last = Batch(decode, prefill, prefill_requests, context)
        self.clock.advance_to(self.started_at + self.step_time.seconds(self.last))
        rows = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _ROWS_BY_INDEX else {}
        output: Future = Future()
        output.set_result(ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **rows))
        return output


@dataclass
class Record:
    """One request's times, in seconds of the virtual clock."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    finished: float | None = None
    tokens: int = 0


@dataclass
class Instance:
    """One simulated instance: its engine core, its traffic and what its requests saw."""

    spec: InstanceSpec
    core: EngineCore
    executor: SimExecutor
    arrivals: list[Arrival]
    next_arrival: int = 0
    ready_at: float = 0.0
    """When its engine loop can take its next step (after its last one, or a wait)."""
    records: dict[str, Record] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    steps: int = 0
    busy_s: float = 0.0
    timeline: list[tuple[float, int, int, int, int | None]] = field(default_factory=list)
    """(time, limit blocks, blocks in use, waiting requests, blocks their prompts need) after each step;
    the last is None unless ``waiting_blocks`` (it walks the whole waiting queue)."""
    waiting_blocks: bool = False
    """Whether each timeline point sums the blocks the waiting requests need (the plot's demand curve)."""

    @property
    def has_requests(self) -> bool:
        return bool(self.core.scheduler.has_requests())

    def next_arrival_at(self) -> float | None:
        return self.arrivals[self.next_arrival].at if self.next_arrival < len(self.arrivals) else None

    def admit(self, now: float) -> None:
        """Add to vLLM's scheduler every request that has arrived by ``now``."""
        block_size, added = self.spec.block_size, False
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].at <= now:
            arrival = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            req_id = f"{self.spec.name}-{self.next_arrival}"
            params = SamplingParams(max_tokens=arrival.output_tokens, ignore_eos=True)
            params.update_from_generation_config({}, EOS_TOKEN_ID)
            base = 100 + (self.next_arrival * 7919) % 20000  # distinct prompts: no prefix shared by chance
            request = Request(
                request_id=req_id,
                prompt_token_ids=[base + i % 50 for i in range(arrival.prompt_tokens)],
                sampling_params=params,
                pooling_params=None,
                arrival_time=arrival.at,
                block_hasher=get_request_block_hasher(block_size, sha256),
            )
            self.records[req_id] = Record(arrival.at, arrival.prompt_tokens, arrival.output_tokens)
            self.requests.append(request)
            self.core.scheduler.add_request(request)
            added = True
        if added:
            # What the plugin's input-queue hook (``_autoscale_after_request``) runs after
            # requests reach a real engine core: a grow they call for comes before the next step.
            engine_core_hooks._between_steps(self.core)

    def step(self, start: float) -> float:
        """One step of vLLM's engine core from ``start`` (the clock there);
        the device seconds it took (0: nothing could be scheduled)."""
        self.executor.started_at = start
        self.executor.last = Batch()
        limit_before = self.limit_blocks()
        outputs, _ = self.core.step()
        now = self.executor.clock.now
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                record = self.records[output.request_id]
                if output.new_token_ids:
                    record.tokens += len(output.new_token_ids)
                    if record.first_token is None:
                        record.first_token = now
                if output.finish_reason is not None:
                    record.finished = now
        took = now - start
        self.steps += 1
        self.busy_s += took
        self.ready_at = now if not self.executor.last.empty else self._retry_at(start, limit_before)
        self.sample(now)
        return took

    def _retry_at(self, start: float, limit_before: int) -> float:
        """When an instance whose step at ``start`` scheduled nothing steps
        again: at once if the decision after that step grew its limit, else
        at its autoscaler's next decision (at most ``EMPTY_STEP_S`` on)."""
        if self.limit_blocks() > limit_before:
            return start
        scaler = utility_methods.autoscaler_of(self.core)
        if scaler is None:
            return start + EMPTY_STEP_S
        return max(start + RETRY_MIN_S, min(start + EMPTY_STEP_S, scaler.last_tick + TICK_S))

    def limit_blocks(self) -> int:
        """The blocks its scheduler may hand out now (the run-time limit, or the whole allocation), null block included."""
        pool = self.core.scheduler.kv_cache_manager.block_pool
        limit = RuntimeLimit.of(pool)
        return int(pool.num_gpu_blocks if limit is None else limit.limit)

    def sample(self, now: float) -> None:
        """The timeline's point at ``now``, at most one per ``SAMPLE_S``."""
        if self.timeline and now - self.timeline[-1][0] < SAMPLE_S:
            return
        pool = self.core.scheduler.kv_cache_manager.block_pool
        limit = RuntimeLimit.of(pool)
        withheld = 0 if limit is None else len(limit.withheld)
        # The free queue itself: the oracle's pool answers get_num_free_blocks with what its budget leaves.
        used = pool.num_gpu_blocks - limit_math.NULL_BLOCKS - pool.free_block_queue.num_free_blocks - withheld
        waiting = self.core.scheduler.waiting
        wanted = None
        if self.waiting_blocks:  # thousands of requests wait in an overloaded run: only for the plot
            block = self.spec.block_size
            wanted = sum(-(-r.num_tokens // block) for r in waiting)
        self.timeline.append((now, self.limit_blocks(), used, len(waiting), wanted))

    @property
    def preemptions(self) -> int:
        return sum(int(getattr(r, "num_preemptions", 0)) for r in self.requests)
