"""The arithmetic of run-time resize (``resize``), without vLLM."""

from __future__ import annotations

import pytest

from vllm_kv_cache_limit.logic.limit_math import (
    Allocation,
    KVCacheResizeError,
    block_spans,
    is_error,
    limit_for,
    merged,
    page_ranges,
    parse_mode,
    parse_target,
    parse_timeout,
    restore_targets,
    status,
)

MiB = 2**20
ALLOC = Allocation(num_blocks=384, bytes_per_block=128 * 1024, blocks_per_request=4, max_model_len=512)


def test_limit_is_whole_blocks_within_the_start_up_allocation() -> None:
    assert limit_for(16 * MiB, ALLOC) == 128
    assert limit_for(16 * MiB + 1000, ALLOC) == 128
    assert limit_for(48 * MiB, ALLOC) == 384


def test_above_the_start_up_allocation_is_refused_with_what_works() -> None:
    with pytest.raises(KVCacheResizeError, match=r"allocated 48MiB \(50331648 bytes\).*at most 48MiB"):
        limit_for(48 * MiB + 1, ALLOC)


def test_below_one_request_is_refused_with_the_least_that_works() -> None:
    least = (ALLOC.blocks_per_request + 1) * ALLOC.bytes_per_block
    assert limit_for(least, ALLOC) == 5
    with pytest.raises(KVCacheResizeError, match=r"max_model_len 512 needs 4 blocks.*at least 640KiB"):
        limit_for(least - 1, ALLOC)


@pytest.mark.parametrize("size", ["", "sixteen", "-1M", 0, -5, 1.5, None, True, [16]])
def test_bad_sizes_are_refused_quoting_them(size: object) -> None:
    with pytest.raises(KVCacheResizeError) as info:
        parse_target(size)
    assert repr(size) in str(info.value) or str(size) in str(info.value)


def test_sizes_with_units_and_bytes() -> None:
    assert parse_target("16M") == 16 * MiB
    assert parse_target(4096) == 4096


@pytest.mark.parametrize("mode", ["later", "", None, "DRAIN"])
def test_bad_modes_are_refused(mode: object) -> None:
    with pytest.raises(KVCacheResizeError, match=r"'drain', 'preempt'"):
        parse_mode(mode)


@pytest.mark.parametrize("timeout", ["soon", -1, float("inf"), float("nan"), None])
def test_bad_timeouts_are_refused(timeout: object) -> None:
    with pytest.raises(KVCacheResizeError, match="timeout_s"):
        parse_timeout(timeout)
    assert parse_timeout("2.5") == 2.5 and parse_timeout(0) == 0


def test_page_ranges_merge_and_keep_only_whole_pages() -> None:
    assert page_ranges([(4096, 8192), (8192, 12288)], 4096) == [(4096, 12288)]
    assert page_ranges([(100, 5000)], 4096) == []  # no whole page inside
    assert page_ranges([(100, 9000)], 4096) == [(4096, 8192)]
    assert page_ranges([(0, 4096), (8192, 12288)], 4096) == [(0, 4096), (8192, 12288)]
    assert page_ranges([(5, 5)], 4096) == []


def test_block_spans_back_to_back_and_strided() -> None:
    # One layer, blocks back to back: one range for blocks [2, 4).
    assert block_spans(1000, 100, 100, 2, 4) == [(1200, 1400)]
    # Block-outermost over two layers: this layer's block is half the stride.
    assert block_spans(1000, 200, 100, 1, 3) == [(1200, 1300), (1400, 1500)]
    assert block_spans(1000, 100, 100, 4, 4) == []


def test_status_holds_only_without_blocks_above_the_limit() -> None:
    held = status(ALLOC, 128, 16 * MiB, "drain", in_use=10, in_use_above=0, released_bytes=32 * MiB)
    assert held["holds"] and held["kv_cache_limit_bytes"] == 16 * MiB and held["num_blocks_allocated"] == 384
    assert not status(ALLOC, 128, 16 * MiB, "drain", 10, 3, 0)["holds"]


def test_data_parallel_status_holds_only_when_every_engine_holds() -> None:
    first = status(ALLOC, 128, 16 * MiB, "drain", 40, 0, 32 * MiB)
    second = status(ALLOC, 128, 16 * MiB, "drain", 90, 3, 0)
    result = merged([first, second])
    assert result["holds"] is False and result["num_blocks_in_use_above_limit"] == 3
    assert result["released_bytes"] == 32 * MiB
    assert result["num_blocks_in_use"] == 40  # the first engine's own fields
    assert result["engines"] == [first, second] and "engines" not in first
    assert merged([first, first])["holds"] is True


def test_data_parallel_engines_that_took_a_refused_change_are_set_back() -> None:
    before = [status(ALLOC, 384, 48 * MiB, "drain", 0, 0, 0), status(ALLOC, 128, 16 * MiB, "preempt", 0, 0, 0)]
    took = status(ALLOC, 256, 32 * MiB, "drain", 0, 0, 0)
    # Engine core 1 failed: engine core 0 goes back to what it had.
    assert restore_targets(before, [took, {"error": "x", "failed": True}]) == [(0, 48 * MiB, "drain")]
    assert restore_targets(before, [{"error": "x"}, took]) == [(1, 16 * MiB, "preempt")]
    # All took it, or none did: nothing to set back.
    assert restore_targets(before, [took, took]) == []
    assert restore_targets(before, [{"error": "x"}, {"error": "y"}]) == []
    assert is_error({"error": "x"}) and not is_error(took) and not is_error(None)
