"""The chunk grid of a VMM-backed KV cache (``logic.vmm_chunks``): pure arithmetic."""

from __future__ import annotations

from vllm_kv_cache_limit.logic.vmm_chunks import ChunkPlan, MiB, plan_chunks

GRANULE = 2 * MiB


def _plan(strides: list[int], capacity: int = 512, target: int = 8 * MiB) -> ChunkPlan:
    offsets = [sum(s * capacity for s in strides[:i]) for i in range(len(strides))]
    plan = plan_chunks(offsets, strides, capacity, GRANULE, target)
    assert isinstance(plan, ChunkPlan), plan
    return plan


def test_a_chunk_is_whole_blocks_and_whole_granules_in_every_segment() -> None:
    plan = _plan([64 << 10, 64 << 10])
    assert plan.blocks_per_chunk == 128  # 32 blocks a granule, times 4 up to 8 MiB
    odd = _plan([48 << 10, 80 << 10])  # 128 blocks of 48 KiB = 3 granules; of 80 KiB: 5
    assert odd.blocks_per_chunk % 128 == 0
    for stride in odd.segment_strides:
        assert odd.blocks_per_chunk * stride % GRANULE == 0
    big = _plan([16 * MiB], capacity=8)  # a block larger than the target: one block a chunk
    assert big.blocks_per_chunk == 1


def test_a_run_is_cut_at_segment_starts_and_chunk_boundaries() -> None:
    plan = _plan([64 << 10, 64 << 10])
    segment = 512 * (64 << 10)
    assert plan.pieces(2 * MiB, segment + 10 * MiB) == [
        (2 * MiB, 6 * MiB),
        (8 * MiB, 8 * MiB),
        (16 * MiB, 8 * MiB),
        (24 * MiB, 8 * MiB),
        (segment, 8 * MiB),
        (segment + 8 * MiB, 4 * MiB),
    ]
    assert plan.pieces(8 * MiB, 8 * MiB) == [(8 * MiB, 8 * MiB)]  # already one chunk


def test_only_chunks_holding_no_block_below_keep_are_releasable() -> None:
    plan = _plan([64 << 10, 64 << 10])
    segment = 512 * (64 << 10)
    chunks = [(o, 8 * MiB) for o in (0, 8 * MiB, 16 * MiB, 24 * MiB)]
    chunks += [(segment + o, 8 * MiB) for o, _ in chunks]
    going = plan.releasable(chunks, keep=200)  # 200 blocks: 12.5 MiB of each segment
    assert going == [
        (16 * MiB, 8 * MiB),
        (24 * MiB, 8 * MiB),
        (segment + 16 * MiB, 8 * MiB),
        (segment + 24 * MiB, 8 * MiB),
    ]
    assert plan.releasable(chunks, keep=512) == []


def test_segments_off_the_granularity_have_no_plan() -> None:
    reason = plan_chunks([0, 3 * MiB], [64 << 10, 64 << 10], 48, GRANULE)
    assert isinstance(reason, str) and "granularity" in reason and str(3 * MiB) in reason
