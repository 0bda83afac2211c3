"""A size an error suggests is one the same call accepts: the suggestion,
parsed back, is within the bounds the error names (property-based)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from vllm_kv_cache_limit.logic.limit_math import Allocation, KVCacheResizeError, limit_for
from vllm_kv_cache_limit.logic.sizes import parse_size

allocations = st.builds(
    Allocation,
    num_blocks=st.integers(2, 100_000),
    bytes_per_block=st.integers(1, 2**24),
    blocks_per_request=st.integers(1, 1000),
    max_model_len=st.just(512),
).filter(lambda a: a.blocks_per_request + 1 <= a.num_blocks)


def _suggested(message: str, bound: str) -> str:
    found = re.search(rf"Choose a size of {bound} ([0-9.]+[A-Za-z]*)", message)
    assert found, message
    return found[1]


@given(allocations, st.data())
def test_the_least_size_suggested_below_one_request_is_accepted(allocation: Allocation, data: st.DataObject) -> None:
    least = (allocation.blocks_per_request + 1) * allocation.bytes_per_block
    nbytes = data.draw(st.integers(1, least - 1))
    try:
        limit_for(nbytes, allocation)
    except KVCacheResizeError as exc:
        suggested = _suggested(str(exc), "at least")
    else:
        raise AssertionError(f"{nbytes} bytes, below {least}, was accepted")
    assert limit_for(parse_size(suggested), allocation) >= allocation.blocks_per_request + 1


@given(allocations, st.integers(1, 2**30))
def test_the_most_size_suggested_above_the_allocation_is_accepted(allocation: Allocation, over: int) -> None:
    try:
        limit_for(allocation.nbytes + over, allocation)
    except KVCacheResizeError as exc:
        suggested = _suggested(str(exc), "at most")
    else:
        raise AssertionError("above the allocation was accepted")
    assert limit_for(parse_size(suggested), allocation) <= allocation.num_blocks


def test_one_mebibyte_below_a_request_suggests_a_size_that_is_accepted() -> None:
    """The case a user met: 1M refused with "at least 1.12MiB", and 1.12MiB refused in turn."""
    allocation = Allocation(num_blocks=384, bytes_per_block=131072, blocks_per_request=8, max_model_len=1024)
    try:
        limit_for(2**20, allocation)
    except KVCacheResizeError as exc:
        suggested = _suggested(str(exc), "at least")
    assert limit_for(parse_size(suggested), allocation) == 9


@given(st.integers(1, 2**50), st.integers(0, 2**50), st.sampled_from(["least", "most"]))
def test_a_suggested_size_reads_back_within_its_bounds(least: int, span: int, prefer: str) -> None:
    from vllm_kv_cache_limit.logic.sizes import suggest_size

    assert least <= parse_size(suggest_size(least, least + span, prefer)) <= least + span
