"""``vllm_kv_cache_limit.logic.kv_cache``: a worker's KV cache tensors, the storages
behind them (views of one buffer count once) and their bytes; the backing
bytes and the bytes per block of a ``KVCacheConfig``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_kv_cache_limit.logic.kv_cache import (
    backing_bytes,
    bytes_per_block,
    kv_cache_storages,
    kv_cache_tensors,
    worker_kv_cache_bytes,
)


def worker_with(kv_caches: object) -> SimpleNamespace:
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches=kv_caches))


def config(sizes: list[int], num_blocks: int) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=s) for s in sizes], num_blocks=num_blocks)


def test_kv_cache_tensors_walks_nested_lists_tuples_and_dicts() -> None:
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    worker = worker_with({"layer0": [a, (b, "not a tensor")], "layer1": {"k": c, "v": [d]}, "none": None})
    assert [t.numel() for t in kv_cache_tensors(worker)] == [1, 2, 3, 4]
    assert kv_cache_tensors(worker_with([])) == []


def test_storages_count_views_of_one_buffer_once() -> None:
    buffer = torch.zeros(1024, dtype=torch.uint8)
    other = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    worker = worker_with([buffer[:512], buffer[512:], other])
    storages = kv_cache_storages(worker)
    assert storages == {
        buffer.untyped_storage().data_ptr(): (1024, "cpu"),
        other.untyped_storage().data_ptr(): (256, "cpu"),
    }
    # The whole storage counts, not the views' elements: 1024 + 256.
    assert worker_kv_cache_bytes(worker) == 1280
    assert worker_kv_cache_bytes(worker_with(buffer[:10])) == 1024
    assert worker_kv_cache_bytes(worker_with({})) == 0


def test_backing_bytes_is_the_one_shared_allocation_not_a_sum() -> None:
    # vLLM 0.29+: every KVCacheTensor of a worker names the same allocation.
    assert backing_bytes(config([4096, 4096, 4096], 8)) == 4096
    assert backing_bytes(config([1024, 4096], 8)) == 4096
    assert backing_bytes(config([], 8)) == 0


@pytest.mark.parametrize(
    ("sizes", "num_blocks", "expected"),
    [
        ([4096, 4096], 4, 1024),  # exact
        ([1000], 3, 334),  # rounded up, never down
        ([1000], 0, 1000),  # no block: at least one
        ([], 5, 0),
    ],
)
def test_bytes_per_block(sizes: list[int], num_blocks: int, expected: int) -> None:
    assert bytes_per_block(config(sizes, num_blocks)) == expected


@given(st.integers(min_value=0, max_value=2**44), st.integers(min_value=1, max_value=2**20))
def test_bytes_per_block_is_the_smallest_that_covers_the_backing(backing: int, num_blocks: int) -> None:
    per_block = bytes_per_block(config([backing], num_blocks))
    assert per_block * num_blocks >= backing > (per_block - 1) * num_blocks


def test_import_loads_neither_torch_nor_vllm() -> None:
    code = "import sys, vllm_kv_cache_limit.logic.kv_cache; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
