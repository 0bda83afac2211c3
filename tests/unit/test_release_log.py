"""What a worker's release of KV cache pages logs: the range released, and
how much of it was resident (``mincore`` before the release), since a
range of never-written blocks frees no memory (the KV cache is mapped
lazily: a page is memory only once written)."""

from __future__ import annotations

import logging
import mmap
import re
from types import SimpleNamespace

import pytest

MiB = 2**20
BLOCK = 256 * 1024
BLOCKS = 64  # 16 MiB


def _worker(kv_cache) -> SimpleNamespace:
    """A worker as the release reads it: its model runner's KV cache tensors
    (real host memory, the device of the CPU backend)."""
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[kv_cache]))


@pytest.mark.parametrize("lazy", [False, True])
def test_the_release_line_reports_the_resident_memory_not_the_range(
    lazy: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    from vllm_kv_cache_limit import register
    from vllm_kv_cache_limit.hooks.runtime import worker

    register()
    # Fresh anonymous pages, mapped and not yet memory (torch.empty may reuse
    # pages an earlier test of this process wrote, already resident).
    area = mmap.mmap(-1, BLOCKS * BLOCK)
    kv_cache = torch.frombuffer(area, dtype=torch.uint8).view(BLOCKS, BLOCK)
    keep, written = 8, 12  # blocks 8..11 written, 12..63 never
    kv_cache[:written].fill_(1)
    # The premise: far less of the range is resident than the range.
    range_bytes = (BLOCKS - keep) * BLOCK
    written_bytes = (written - keep) * BLOCK
    assert written_bytes * 4 < range_bytes
    caplog.set_level(logging.INFO, logger="vllm.plugins.kv_cache_limit")
    released = worker.kv_cache_limit_pages(_worker(kv_cache), keep, BLOCKS, True, lazy)
    # The whole pages of the range, as the status's released_bytes.
    assert range_bytes - mmap.PAGESIZE <= released <= range_bytes
    line = next(r.getMessage() for r in caplog.records if "KV cache pages of blocks 8-63 released" in r.getMessage())
    found = re.search(r"a range of (\d+) bytes, (\d+) of them resident", line)
    assert found, line
    assert int(found[1]) == released
    resident = int(found[2])
    # What was written (whole pages), not the range; a page or two either side at most.
    assert abs(resident - written_bytes) <= 2 * mmap.PAGESIZE, line
