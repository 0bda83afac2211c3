"""The block-pool side of run-time resize on vLLM's own ``BlockPool`` (no
engine): blocks above the limit leave the free queue, blocks freed above it
are withheld, usage is relative to the limit, and a grow gives them back."""

from __future__ import annotations

import pytest

from vllm_kv_cache_limit import register
from vllm_kv_cache_limit.resize import Allocation

BLOCKS = 10


@pytest.fixture
def pool():
    register()  # installs the hooks, BlockPool's wrappers included
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=16)


def limit_of(pool, limit: int):
    from vllm_kv_cache_limit import _resize_hooks

    allocation = Allocation(num_blocks=BLOCKS, bytes_per_block=1024, blocks_per_request=1, max_model_len=16)
    state = _resize_hooks._Limit(allocation=allocation, limit=BLOCKS, requested=allocation.nbytes)
    pool._kvcl_limit = state
    state.limit = limit
    return state


def test_free_blocks_above_the_limit_leave_the_queue(pool) -> None:
    state = limit_of(pool, 4)
    state.withhold(pool, pool.blocks[4:])
    assert pool.get_num_free_blocks() == 3  # blocks 1-3; block 0 is vLLM's null block
    assert sorted(b.block_id for b in pool.get_new_blocks(3)) == [1, 2, 3]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_blocks_freed_above_the_limit_are_withheld(pool) -> None:
    held = pool.get_new_blocks(BLOCKS - 1)  # every block in use
    state = limit_of(pool, 4)
    pool.free_blocks([b for b in held if b.block_id in (5, 6)])
    assert pool.get_num_free_blocks() == 0 and state.withheld == {5, 6}
    pool.free_blocks([b for b in held if b.block_id == 2])
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(1 - 1 / 3)  # 3 usable blocks under the limit


def test_without_a_limit_vllm_is_untouched(pool) -> None:
    held = pool.get_new_blocks(BLOCKS - 1)
    pool.free_blocks(held[:4])
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == pytest.approx(1 - 4 / 9)


def test_grow_gives_withheld_blocks_back(pool) -> None:
    from vllm_kv_cache_limit import _resize_hooks

    state = limit_of(pool, 4)
    state.withhold(pool, pool.blocks[4:])
    state.limit = 7
    _resize_hooks._grow(None, pool, state)
    assert state.withheld == {7, 8, 9}
    assert sorted(b.block_id for b in pool.get_new_blocks(6)) == [1, 2, 3, 4, 5, 6]
