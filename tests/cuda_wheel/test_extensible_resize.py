"""A run-time limit moves real GPU memory on vLLM 0.34's extensible KV cache
(issue 42): vLLM's own ``extend_kv_cache``, ``ExtensibleKVCache``,
``ExtensibleTensor``, ``BlockPool``, ``KVCacheManager``, ``Scheduler`` and
``EngineCore.step`` run through the plugin; only the VMM driver is the
host-memory stand-in (``tests/cuda_wheel/vmm_standin.py``), which enforces
CUDA's rules and counts what is mapped, so that memory returned is measured
in this process (``RssShmem``: the stand-in's chunks are memfd pages).

The workers are this process: the engine core's ``collective_rpc`` calls the
plugin's real worker methods on a worker whose model runner holds the cache.
"""

from __future__ import annotations

import copy
import signal
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.utils.extensible_tensor as extensible_tensor
import vllm.v1.worker.extensible_kv_cache as vllm_extensible
import vllm.v1.worker.gpu_worker as gpu_worker  # before the fake CUDA platform: its import asks the kernels
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor
from vllm.v1.worker.worker_base import WorkerBase

from tests.cuda_wheel import test_resize_scheduler as sched
from tests.cuda_wheel.conftest import FakeGPU
from tests.cuda_wheel.test_vmm_standin import RSS_SLACK, read_in_child, rss_shmem
from tests.cuda_wheel.vmm_standin import HostVmmDriver, MiB, VmmRuleError
from vllm_kv_cache_limit.hooks.runtime import autoscaler
from vllm_kv_cache_limit.hooks.runtime.autoscaler import Autoscaler
from vllm_kv_cache_limit.hooks.runtime.engine_core import start_autoscaling
from vllm_kv_cache_limit.hooks.runtime.limit import EngineCoreState, RuntimeLimit
from vllm_kv_cache_limit.hooks.runtime.utility_methods import start_at
from vllm_kv_cache_limit.hooks.worker_state import WorkerState
from vllm_kv_cache_limit.hooks.wrap import WRAPPED
from vllm_kv_cache_limit.logic import envs, limit_math

GRANULE = 2 * MiB
SPEC = FullAttentionSpec(block_size=sched.BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16)
PAGE = SPEC.page_size_bytes
"""16 tokens x 8 heads x 128 x K and V x 2 bytes: 64 KiB per layer and block."""
LAYERS = sched.LAYERS
NUM_BLOCKS = 512
"""32 MiB per layer: the cache's capacity and the block pool's size."""
BLOCKS_PER_CHUNK = 128
"""The plan: 32 blocks make a 2 MiB granule, times 4 up to 8 MiB (``TARGET_CHUNK_BYTES``)."""
BYTES_PER_BLOCK = PAGE * len(LAYERS)
LIMIT = 200
"""Lowered limit: blocks 200-255 stay in the second chunk, 256-511 go."""


class _Workers:
    """The executor of one worker in this process: the plugin's worker
    methods run for real on it."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.pages_calls: list[tuple[Any, ...]] = []
        self.inner = sched._Workers()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        if method == "kv_cache_limit_allocated":
            return [NUM_BLOCKS * BYTES_PER_BLOCK]
        if method == "kv_cache_limit_chunk_blocks":
            return [WorkerBase.kv_cache_limit_chunk_blocks(self.worker)]
        if method == "kv_cache_limit_committable":
            return [WorkerBase.kv_cache_limit_committable(self.worker)]
        if method == "kv_cache_limit_pages":
            self.pages_calls.append(tuple(args))
            return [WorkerBase.kv_cache_limit_pages(self.worker, *args)]
        if method == "kv_cache_limit_hold_entries":  # the worker is this process: the entries go with it
            return [0]
        raise AssertionError(f"unexpected worker call {method}{args}")

    def execute_model(self, scheduler_output: Any, non_block: bool = False):
        return self.inner.execute_model(scheduler_output, non_block)


def _kv_cache_config() -> KVCacheConfig:
    tensor = KVCacheTensor(
        size=len(LAYERS) * NUM_BLOCKS * PAGE, layers=list(LAYERS), layer_stride=NUM_BLOCKS * PAGE, block_stride=PAGE
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), SPEC)]
    )


def _engine(
    tiny_model: str,
    cap: int | None = NUM_BLOCKS * BYTES_PER_BLOCK,
    hisparse: bool = False,
    measure_with: FakeGPU | None = None,
) -> EngineCore:
    """An engine core over vLLM's scheduler, its one worker's extensible KV
    cache extended by vLLM's ``extend_kv_cache`` (through the plugin) to all
    ``NUM_BLOCKS`` blocks; ``measure_with``: vLLM's worker measured the
    memory after warmup on that GPU first (``measure_kv_cache_blocks``)."""
    scheduler = sched._scheduler(tiny_model)
    config = _kv_cache_config()
    vllm_config = scheduler.vllm_config
    vllm_config.cache_config.enable_extensible_kv_cache = True
    vllm_config.cache_config.kv_cache_max_memory = cap  # as the plugin's argument sets it
    if hisparse:
        vllm_config.attention_config.hisparse_config = SimpleNamespace()
    return extended_core(scheduler, config, KVCacheLayout.LBNHC, cap, NUM_BLOCKS, measure_with)


def extended_core(
    scheduler: Any,
    config: KVCacheConfig,
    layout: KVCacheLayout,
    cap: int | None,
    num_blocks: int,
    measure_with: FakeGPU | None = None,
) -> EngineCore:
    """An engine core over ``scheduler`` whose one worker's extensible KV
    cache (``config``, ``layout``) vLLM's ``extend_kv_cache`` extends
    (through the plugin) to ``num_blocks``; ``measure_with``: vLLM's worker
    measured the memory after warmup on that GPU first."""
    vllm_config = scheduler.vllm_config
    cache = ExtensibleKVCache(config, torch.device("cuda:0"), layout)
    cache.allocate(cache.size)
    runner = SimpleNamespace(
        vllm_config=vllm_config,
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, kv_cache_max_memory=cap),
        extensible_kv_cache=cache,
        kv_cache_config=copy.copy(config),
        kernel_block_sizes=None,
        attn_groups=[],
        speculator=None,
        kv_caches_by_layer={},
        kv_caches=[],
        device=torch.device("cuda:0"),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    if measure_with is not None:
        vllm_extensible.measure_kv_cache_blocks(
            cache,
            vllm_config,
            torch.device("cuda:0"),
            init_free_memory=measure_with.free,
            requested_memory=measure_with.total,
        )
    vllm_extensible.extend_kv_cache(runner, config, num_blocks)
    core = sched._engine_core(scheduler)
    core.model_executor = _Workers(SimpleNamespace(model_runner=runner))
    return core


@pytest.fixture
def engine(fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    core = _engine(tiny_model)
    yield core
    _cache(core).free()


def _cache(core: EngineCore) -> ExtensibleKVCache:
    return core.model_executor.worker.model_runner.extensible_kv_cache


def _fill(cache: ExtensibleKVCache, blocks: range, value: int) -> None:
    full = cache.buffer.full_view()
    for offset in cache.segment_offsets:
        full[offset + blocks.start * PAGE : offset + blocks.stop * PAGE].fill_(value)


def _holds(cache: ExtensibleKVCache, blocks: range, value: int) -> bool:
    full = cache.buffer.full_view()
    return all(
        bool((full[offset + blocks.start * PAGE : offset + blocks.stop * PAGE] == value).all())
        for offset in cache.segment_offsets
    )


def _set(core: EngineCore, blocks: int) -> dict[str, Any]:
    return core.kv_cache_limit_set(blocks * BYTES_PER_BLOCK, "drain")


def _chunked(blocks: int) -> int:
    """Bytes mapped for ``blocks`` blocks in whole chunks, over every layer."""
    return min(NUM_BLOCKS, -(-blocks // BLOCKS_PER_CHUNK) * BLOCKS_PER_CHUNK) * BYTES_PER_BLOCK


def test_the_plugin_maps_the_capped_cache_in_chunks(engine: EngineCore, driver: HostVmmDriver) -> None:
    assert getattr(extensible_tensor._VirtualBuffer._map_chunk_at, WRAPPED, False)
    assert getattr(vllm_extensible.extend_kv_cache, WRAPPED, False)
    cache = _cache(engine)
    assert cache.num_committed_blocks == NUM_BLOCKS
    assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK
    chunk = BLOCKS_PER_CHUNK * PAGE
    base = cache.buffer.base_ptr
    for addr, size, _ in driver.mapped_ranges():
        offset = addr - base
        segment = max(o for o in cache.segment_offsets if o <= offset)
        start = offset - segment
        assert (start + size - 1) // chunk == start // chunk, f"a mapping at {offset:#x} crosses a chunk boundary"
        assert start // chunk == 0 or size == chunk  # only the null block's granule was mapped before the plan
    assert cache.buffer.num_physical_chunks == len(LAYERS) * (NUM_BLOCKS // BLOCKS_PER_CHUNK + 1)


def test_a_cache_without_a_cap_is_mapped_as_vllm_maps_it(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    core = _engine(tiny_model, cap=None)
    try:
        # the null block's granule (allocate), then the rest in one chunk per layer (extend_kv_cache)
        assert sorted(size for _, size, _ in driver.mapped_ranges()) == [GRANULE] * len(LAYERS) + [
            NUM_BLOCKS * PAGE - GRANULE
        ] * len(LAYERS)
    finally:
        _cache(core).free()


def test_a_shrink_returns_the_chunks_above_and_keeps_the_blocks_below(
    engine: EngineCore, driver: HostVmmDriver
) -> None:
    cache = _cache(engine)
    _fill(cache, range(1, LIMIT), 7)
    _fill(cache, range(LIMIT, NUM_BLOCKS), 9)
    mapped, rss = driver.mapped_bytes, rss_shmem()

    status = _set(engine, LIMIT)
    assert not limit_math.is_error(status), status

    returned = NUM_BLOCKS * BYTES_PER_BLOCK - _chunked(LIMIT)
    assert returned == 256 * BYTES_PER_BLOCK
    assert mapped - driver.mapped_bytes == returned
    assert driver.physical_bytes == driver.mapped_bytes == _chunked(LIMIT)
    assert abs(rss - rss_shmem() - returned) <= RSS_SLACK
    assert cache.num_committed_blocks == LIMIT
    assert _holds(cache, range(1, LIMIT), 7)
    assert _holds(cache, range(LIMIT, 256), 9)  # the chunk across the limit stays whole
    above = cache.buffer.base_ptr + cache.segment_offsets[1] + 300 * PAGE
    assert read_in_child(above) == -signal.SIGSEGV  # a block above the limit is not mapped

    status = _set(engine, NUM_BLOCKS)
    assert not limit_math.is_error(status), status
    assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK
    assert cache.num_committed_blocks == NUM_BLOCKS
    assert _holds(cache, range(1, LIMIT), 7)  # below the limit: unchanged through shrink and grow
    assert _holds(cache, range(LIMIT, NUM_BLOCKS), 0)  # regrown (and above the old limit): zeroed
    assert read_in_child(above) == 0


def test_requests_keep_running_below_the_limit_and_the_release_waits_for_the_drain(
    engine: EngineCore, driver: HostVmmDriver
) -> None:
    """Requests on blocks above the limit finish first (drain); the chunks go
    after, between steps."""
    cache = _cache(engine)
    pool = engine.scheduler.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(300)  # a request holding blocks up to 300
    status = _set(engine, LIMIT)
    assert not limit_math.is_error(status), status
    assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK  # in use: nothing returned yet
    pool.free_blocks(taken)
    RuntimeLimit.of(pool).release_if_due()  # what the engine core does between steps
    assert driver.mapped_bytes == _chunked(LIMIT)
    assert cache.num_committed_blocks == LIMIT


def _block_tables(rows: list[list[int]], width: int = 40) -> BlockTables:
    """vLLM 0.34's block tables of one KV cache group, as its GPU model runner
    holds them, their device copies on the host: each row as vLLM's kernels
    leave it (written from its start, the rest as it was). vLLM's
    ``BlockTables`` and ``StagedWriteTensor`` built without ``__init__``,
    which pins host memory for their staging buffers (CUDA calls); only
    their device tables are set, as host tensors."""
    tables = BlockTables.__new__(BlockTables)
    staged = StagedWriteTensor.__new__(StagedWriteTensor)
    staged.gpu = torch.zeros((len(rows), width), dtype=torch.int32)
    tables.block_tables = [staged]
    tables.input_block_tables = [torch.zeros_like(staged.gpu)]
    for index, row in enumerate(rows):
        tables.block_tables[0].gpu[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tables.input_block_tables[0][index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return tables


def test_a_shrink_points_stale_block_table_entries_above_the_limit_at_the_null_block(
    engine: EngineCore, driver: HostVmmDriver
) -> None:
    """vLLM leaves a row's ids past its length as a finished request left
    them; after a release they would name unmapped memory. The plugin points
    those at or above the limit at the null block, and leaves the rest."""
    live = list(range(1, 30))  # a request still running, below the limit
    stale = [*range(30, 60), 300, 511, 250, 199, 200]  # a finished request's ids, left in the row
    rows = [live + stale[len(live) :], stale, [7, 8, 9]]
    tables = _block_tables(rows)
    engine.model_executor.worker.model_runner.block_tables = tables
    before = [table.clone() for table in (tables.block_tables[0].gpu, tables.input_block_tables[0])]
    assert any(int((table >= LIMIT).sum()) for table in before)  # the premise: stale ids above the limit

    assert not limit_math.is_error(_set(engine, LIMIT))

    for table, old in zip((tables.block_tables[0].gpu, tables.input_block_tables[0]), before):
        assert int(table.max()) < LIMIT
        assert torch.equal(table, torch.where(old >= LIMIT, torch.zeros_like(old), old))
    assert tables.block_tables[0].gpu[0, : len(live)].tolist() == live
    assert tables.block_tables[0].gpu[2, :3].tolist() == [7, 8, 9]


def test_a_driver_failure_while_growing_leaves_the_limit_and_nothing_half_mapped(
    engine: EngineCore, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(engine)
    assert not limit_math.is_error(_set(engine, LIMIT))
    mapped, chunks = driver.mapped_bytes, cache.buffer.num_physical_chunks
    creates = driver.calls["create"]
    original = driver.create

    def create(size: int, device_index: int, export_handle_types: int = 0) -> int:
        if driver.calls["create"] - creates >= 3:  # the fourth chunk fails
            raise VmmRuleError(2, "cuMemCreate", "out of memory")
        return original(size, device_index, export_handle_types)

    monkeypatch.setattr(driver, "create", create)
    status = _set(engine, NUM_BLOCKS)
    assert limit_math.is_error(status) and status.get("failed"), status
    assert "out of memory" in status["error"]
    limit = RuntimeLimit.of(engine.scheduler.kv_cache_manager.block_pool)
    assert limit.limit == LIMIT
    assert max(b.block_id for b in limit.pool.free_block_queue.get_all_free_blocks()) < LIMIT
    assert driver.mapped_bytes == driver.physical_bytes == mapped  # nothing half mapped
    assert cache.buffer.num_physical_chunks == chunks and cache.num_committed_blocks == LIMIT

    monkeypatch.setattr(driver, "create", original)
    assert not limit_math.is_error(_set(engine, NUM_BLOCKS))
    assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK


def test_sleep_and_wake_under_a_limit_recommit_up_to_the_limit(engine: EngineCore, driver: HostVmmDriver) -> None:
    cache = _cache(engine)
    assert not limit_math.is_error(_set(engine, LIMIT))
    cache.release_physical()  # the worker's sleep
    assert driver.mapped_bytes == 0
    cache.recommit()  # its wake-up: vLLM commits the blocks it counts, to whole granules
    assert driver.mapped_bytes == cache.physical_bytes_for(LIMIT) < NUM_BLOCKS * BYTES_PER_BLOCK

    cache.release_physical()
    assert not limit_math.is_error(_set(engine, 300))  # raised while asleep: nothing mapped now
    assert driver.mapped_bytes == 0
    cache.recommit()
    assert driver.mapped_bytes == cache.physical_bytes_for(300)


def test_a_limit_changed_during_a_weight_update_loan_is_committed_at_its_end(
    engine: EngineCore, driver: HostVmmDriver, fake_gpu: FakeGPU
) -> None:
    """vLLM 0.34 lends the whole cache's memory to a layerwise weight update
    when the device is short (``kv_cache_lent_for_weight_update``) and
    recommits it after; a limit changed meanwhile is what comes back."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    cache = _cache(engine)
    model = torch.nn.Linear(1024, 1024)  # a 4 MiB layer: the update needs about 12 MiB free
    record_metadata_for_reloading(model)
    fake_gpu.free = 0  # the device is short: vLLM lends the cache
    for limit in (LIMIT, 300):  # lowered during one loan, raised during the next
        with vllm_extensible.kv_cache_lent_for_weight_update(cache, model, reclaimable=True, fail_if_short=True):
            assert driver.mapped_bytes == 0  # the premise: the whole cache is lent
            assert not limit_math.is_error(_set(engine, limit))
            assert driver.mapped_bytes == 0  # nothing committed during the loan
        assert cache.num_committed_blocks == limit
        assert driver.mapped_bytes == cache.physical_bytes_for(limit) < NUM_BLOCKS * BYTES_PER_BLOCK


def test_two_caches_on_one_device_trade_memory(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One device holds both caches: the second can grow only into what the
    first returned, and its failed grow leaves it as it was."""
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    first, second = _engine(tiny_model), _engine(tiny_model)
    try:
        assert not limit_math.is_error(_set(second, 100))
        driver.capacity = driver.physical_bytes  # the device is full
        status = _set(second, NUM_BLOCKS)
        assert limit_math.is_error(status) and "out of memory" in status["error"]
        assert driver.physical_bytes == driver.capacity

        assert not limit_math.is_error(_set(first, 100))  # the first shrinks
        assert driver.physical_bytes == driver.capacity - (NUM_BLOCKS * BYTES_PER_BLOCK - _chunked(100))
        assert not limit_math.is_error(_set(second, NUM_BLOCKS))  # the second's grow now fits
        assert _cache(second).num_committed_blocks == NUM_BLOCKS
        assert driver.physical_bytes == _chunked(100) + NUM_BLOCKS * BYTES_PER_BLOCK
    finally:
        _cache(first).free()
        _cache(second).free()


def test_a_feature_that_needs_the_whole_mapping_refuses_a_lower_limit(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    core = _engine(tiny_model, hisparse=True)
    try:
        assert sorted(size for _, size, _ in driver.mapped_ranges()) == [GRANULE] * len(LAYERS) + [
            NUM_BLOCKS * PAGE - GRANULE
        ] * len(LAYERS)
        status = _set(core, LIMIT)
        assert limit_math.is_error(status)
        assert "HiSparse" in status["error"] and "--no-enable-extensible-kv-cache" in status["error"]
        assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK
    finally:
        _cache(core).free()


BUDGET_BLOCKS = 384
"""The shared budget and the device: three chunks of 128 blocks."""


def _autoscaled(tiny_model: str, budget: int) -> EngineCore:
    core = _engine(tiny_model)
    cache_config = core.vllm_config.cache_config
    setattr(cache_config, autoscaler.AUTOSCALE, True)
    setattr(cache_config, autoscaler.MIN_MEMORY, None)
    setattr(cache_config, autoscaler.SHARED_BUDGET, budget)
    start_autoscaling(core)
    scaler = _scaler(core)
    scaler.stop.set()
    if scaler.timer is not None:
        scaler.timer.join(timeout=5)
    return core


def _scaler(core: EngineCore) -> Autoscaler:
    scaler = EngineCoreState.of(core).autoscaler
    assert isinstance(scaler, Autoscaler)
    return scaler


def _decide(core: EngineCore, at: float) -> None:
    """One autoscaling decision at monotonic time ``at``, then the release
    the engine core makes between steps."""
    limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool)
    _scaler(core).tick(core, limit, now=at)
    limit.release_if_due()


def _ledger_holds(core: EngineCore) -> int:
    """What every instance's entry in this device's ledger holds, in bytes."""
    scaler = _scaler(core)
    return scaler.held * scaler.unit + sum(int(o["holds"]) for o in scaler.others)


def test_two_autoscaled_caches_under_one_shared_budget_trade_committed_memory(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """The ledger accounts what the caches commit: the device holds exactly
    the budget's entries, and the second instance grows into what the
    first returned, on a device that has no more than the budget."""
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    monkeypatch.setenv(envs.LOCK_DIR, str(tmp_path))
    monkeypatch.setenv(envs.SHRINK_AFTER_S, "0")
    budget = BUDGET_BLOCKS * BYTES_PER_BLOCK
    first = second = None
    try:
        first = _autoscaled(tiny_model, budget)
        second = _autoscaled(tiny_model, budget)
        assert _scaler(first).allocation.blocks_per_chunk == BLOCKS_PER_CHUNK
        floor = _scaler(first).floor
        assert floor == BLOCKS_PER_CHUNK  # one request of max_model_len, rounded up to a chunk
        assert driver.physical_bytes == 2 * floor * BYTES_PER_BLOCK
        driver.capacity = budget  # the device has the budget and no more
        now = time.monotonic()

        sched._add(first, [str(i) for i in range(20)], max_tokens=1000)  # 8 blocks each
        first.step()
        _decide(second, now + 1)  # the second's entry is read again
        _decide(first, now + 1)
        assert RuntimeLimit.of(first.scheduler.kv_cache_manager.block_pool).limit == 2 * BLOCKS_PER_CHUNK
        assert driver.physical_bytes == _ledger_holds(first) == budget  # the ledger is what is committed

        sched._add(second, [str(i) for i in range(20)], max_tokens=1000)
        second.step()
        _decide(second, now + 2)  # the budget is full: the second stays at its floor
        assert RuntimeLimit.of(second.scheduler.kv_cache_manager.block_pool).limit == floor
        first.abort_requests([str(i) for i in range(20)])
        _decide(first, now + 3)  # idle, and another instance needs the budget: back to its floor
        _decide(first, now + 4)
        assert driver.physical_bytes == 2 * floor * BYTES_PER_BLOCK
        _decide(second, now + 5)
        assert RuntimeLimit.of(second.scheduler.kv_cache_manager.block_pool).limit == 2 * BLOCKS_PER_CHUNK
        assert driver.physical_bytes == _ledger_holds(second) == budget
    finally:
        for core in (first, second):
            if core is not None:
                _scaler(core).close()
                _cache(core).free()


def test_a_cache_extended_to_the_cap_commits_what_warmup_measured_and_grows_to_the_cap_once_memory_frees(
    fake_gpu: FakeGPU, tiny_model: str, driver: HostVmmDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warmup left room for fewer blocks than the cap: the engine core gives
    the workers the cap's blocks (block pool, views), each worker commits
    what it measured, the engine starts with a limit there, a raise past
    what vLLM can commit beside its activation headroom is refused, and
    once the device frees memory the limit grows to the cap, committing the
    memory as it does."""
    assert gpu_worker.measure_kv_cache_blocks is vllm_extensible.measure_kv_cache_blocks  # the worker calls the wrapper
    assert gpu_worker.extend_kv_cache is vllm_extensible.extend_kv_cache
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device=None: None)
    monkeypatch.setattr(sched, "NUM_BLOCKS", NUM_BLOCKS)
    fake_gpu.free = (1 << 30) + 20 * MiB  # vLLM keeps 1 GiB free: about 20 MiB for the cache
    core = _engine(tiny_model, measure_with=fake_gpu)
    try:
        cache = _cache(core)
        runner = core.model_executor.worker.model_runner
        # The cache's state is its worker's, under one name; its buffer keeps its chunks under one.
        assert sorted(name for name in vars(cache) if name.startswith("_kvcl_")) == ["_kvcl_worker"]
        assert sorted(name for name in vars(cache.buffer._buffer) if name.startswith("_kvcl_")) == ["_kvcl_chunks"]
        state = WorkerState.peek(cache)
        assert state is not None and WorkerState.peek(runner.vllm_config) is state
        assert WorkerState.peek(runner.vllm_config.cache_config) is state
        assert WorkerState.peek(runner.vllm_config.compilation_config) is state
        measured = state.measured
        assert measured is not None and 100 < measured < 2 * BLOCKS_PER_CHUNK < NUM_BLOCKS
        assert state.started == measured
        assert runner.kv_cache_config.num_blocks == NUM_BLOCKS  # views and block tables cover the cap
        assert cache.num_committed_blocks == measured
        assert driver.mapped_bytes == cache.physical_bytes_for(measured) < NUM_BLOCKS * BYTES_PER_BLOCK

        start_at(core, measured)
        limit = RuntimeLimit.of(core.scheduler.kv_cache_manager.block_pool)
        assert limit.limit == measured
        assert max(b.block_id for b in limit.pool.free_block_queue.get_all_free_blocks()) < measured
        assert driver.mapped_bytes == cache.physical_bytes_for(measured)

        assert limit_math.is_error(_set(core, NUM_BLOCKS))  # vLLM's committable_blocks: no more fit
        assert driver.mapped_bytes == cache.physical_bytes_for(measured)
        fake_gpu.free += 2 << 30
        assert not limit_math.is_error(_set(core, NUM_BLOCKS))  # the neighbour left: up to the cap
        assert driver.mapped_bytes == NUM_BLOCKS * BYTES_PER_BLOCK
        assert cache.num_committed_blocks == NUM_BLOCKS
    finally:
        _cache(core).free()
