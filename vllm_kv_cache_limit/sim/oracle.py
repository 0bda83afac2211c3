"""The ``oracle`` scenario: one pool of KV cache memory shared by all
instances with no floors and no decision delay, the upper bound of any
sharing policy.

Each instance's vLLM scheduler gets the whole budget as its allocation;
what the pool enforces is only the sum: at every allocation the free
blocks an instance's scheduler sees (``BlockPool.get_num_free_blocks``,
which vLLM's ``KVCacheManager`` asks before it allocates and
``BlockPool.get_new_blocks`` before it hands blocks out) are the fewer of
its own free blocks and those the budget has left after every instance's
blocks in use. A block one instance frees is at once free to any other;
there are no limits, floors, hysteresis or ledger. The device runs one
instance's step at a time, so the sum holds at every instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class SharedPool:
    """The budget in bytes over the block pools of the instances that share it."""

    budget_bytes: int
    pools: list[tuple[Any, int]]
    """(vLLM's ``BlockPool``, its bytes per block) of each instance."""

    def used_bytes(self) -> int:
        """Bytes of the blocks in use in every pool, each pool's null block included."""
        return sum(
            (pool.num_gpu_blocks - pool.free_block_queue.num_free_blocks) * bytes_per_block
            for pool, bytes_per_block in self.pools
        )

    def free_blocks(self, pool: Any, bytes_per_block: int) -> int:
        """The free blocks ``pool``'s scheduler may take now: its own, up to what the budget has left."""
        left = max(0, self.budget_bytes - self.used_bytes()) // bytes_per_block
        return min(pool.free_block_queue.num_free_blocks, left)

    def counter(self, pool: Any, bytes_per_block: int) -> Callable[[], int]:
        return lambda: self.free_blocks(pool, bytes_per_block)


def share(budget_bytes: int, pools: list[tuple[Any, int]]) -> SharedPool:
    """Make the ``pools`` (each allocated the whole budget) draw on one budget.
    Their null blocks count against it, as each instance's does under a cap."""
    shared = SharedPool(budget_bytes, pools)
    for pool, bytes_per_block in pools:
        pool.get_num_free_blocks = shared.counter(pool, bytes_per_block)
    return shared
