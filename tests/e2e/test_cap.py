"""The cap on real vLLM CPU engines with the tiny model, measured in the
worker (bytes of the KV cache tensors' storages, via LLM.collective_rpc).
A cap that binds (16M under vLLM's budget) is checked with the ``LLM(...)``
keyword in ``test_python_api``."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import cap_error, node_memory

# Not alone (tests/conftest.py, ALONE_MODULES): its premises on the memory node's free memory
# keep gigabytes of margin, and each is asserted where it is made.
MiB = 2**20
INFO_RE = re.compile(
    r"KV cache max memory: \S+ = (?P<cap>\d+) bytes .*? vLLM budget (?P<budget>\d+) bytes .*?; "
    r"cap (?P<bound>bound|not bound).*?; (?P<blocks>\d+) blocks, (?P<tokens>\d+) tokens"
)


def info_line(log: str) -> re.Match[str]:
    matches = list(INFO_RE.finditer(log))
    assert len(matches) == 1, f"expected one INFO line per engine, got {len(matches)}:\n{log[-3000:]}"
    return matches[0]


def block_bytes(result: dict) -> int:
    (allocated,) = result["kv_cache_bytes"]
    assert allocated % result["num_gpu_blocks"] == 0
    return allocated // result["num_gpu_blocks"]


def test_cap_above_budget_changes_nothing(probe) -> None:
    # vLLM's CPU budget is 25% of the node's memory less the worker's resident
    # memory; 40% of the node is above it and below the free memory. (The
    # node's memory is read live: on these VMs it grows during a session.)
    cap = int(0.4 * _node_total_memory())
    assert node_memory()[0] > cap  # the premise: the cap fits in what is free
    result, log = probe(kv_cache_max_memory=cap)
    assert result["ok"], result
    line = info_line(log)
    budget = int(line["budget"])
    assert budget < cap and line["bound"] == "not bound"
    per_block = block_bytes(result)
    # Exactly what vLLM makes of its own budget: whole blocks, less than one
    # block's worth under it.
    (allocated,) = result["kv_cache_bytes"]
    assert allocated <= budget < allocated + per_block


@pytest.mark.smoke
@pytest.mark.plugin_only  # VLLM_KV_CACHE_MAX_MEMORY
def test_env_var_supplies_cap_and_smaller_explicit_size_is_kept(probe) -> None:
    result, log = probe(env={"VLLM_KV_CACHE_MAX_MEMORY": "32M"}, kv_cache_memory_bytes=16 * MiB)
    assert result["ok"], result
    assert result["kv_cache_max_memory"] == 32 * MiB
    assert result["kv_cache_memory_bytes"] == 16 * MiB
    assert result["kv_cache_bytes"] == [16 * MiB]
    assert "reducing kv_cache_memory_bytes" not in log


@pytest.mark.smoke
def test_larger_explicit_size_is_reduced_to_cap_with_warning(probe) -> None:
    result, log = probe(kv_cache_max_memory="16M", kv_cache_memory_bytes=64 * MiB)
    assert result["ok"], result
    assert result["kv_cache_memory_bytes"] == 16 * MiB
    assert result["kv_cache_bytes"] == [16 * MiB]
    assert re.search(r"WARNING.*kv_cache_memory_bytes=67108864 .* larger than kv_cache_max_memory=16777216", log)


def test_block_override_is_reduced_to_blocks_within_cap(probe) -> None:
    result, log = probe(kv_cache_max_memory="16M", num_gpu_blocks_override=1000)
    assert result["ok"], result
    (allocated,) = result["kv_cache_bytes"]
    per_block = block_bytes(result)
    assert result["num_gpu_blocks"] == 16 * MiB // per_block < 1000
    assert allocated <= 16 * MiB
    assert re.search(r"WARNING.*num_gpu_blocks_override=1000 .*reducing it to \d+ blocks", log)


@pytest.mark.smoke
def test_cap_too_small_for_max_model_len_fails_with_message(probe) -> None:
    result, log = probe(kv_cache_max_memory="300K")
    message = cap_error(result, log)
    assert "--kv-cache-max-memory" in message and "max_model_len=512" in message
    # vLLM's own estimate of the largest max_model_len that fits.
    fit = re.search(r"--max-model-len (\d+)", message)
    assert fit and 0 < int(fit[1]) < 512


def _node_total_memory() -> int:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    return get_memory_node_info(get_allowed_cpu_list()[0].numa_node).total_memory


@pytest.mark.plugin_only  # the fit check before weights load
def test_cap_above_free_memory_fails_before_weights_load(probe) -> None:
    # Below the node's total (so the total check passes), above what is free.
    cap = _node_total_memory() - 16 * MiB
    assert node_memory()[0] * 101 // 100 < cap  # the premise: beyond the 1% tolerance too
    result, log = probe(kv_cache_max_memory=cap)
    assert not result["ok"]
    assert result["error_type"] == "KVCacheMaxMemoryError"
    assert "cannot fit on the host memory node" in result["error"]
    assert re.search(r"\(\d+ bytes\) is free, less than the cap plus the weights", result["error"])
    assert "Loading weights" not in log and "KV cache max memory:" not in log


@pytest.mark.smoke
def test_cap_above_device_total_fails_before_weights_load(probe) -> None:
    result, log = probe(kv_cache_max_memory="100T")
    assert "larger than the total memory" in cap_error(result, log)
    assert "EngineCore" not in log and "Loading weights" not in log


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ({"kv_cache_memory_bytes": 8 * MiB}, 8 * MiB),
        ({"num_gpu_blocks_override": 64}, None),  # 64 blocks
        ({"env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}, 1024 * MiB),
    ],
    ids=["kv_cache_memory_bytes", "num_gpu_blocks_override", "VLLM_CPU_KVCACHE_SPACE"],
)
def test_explicit_size_that_fits_starts_under_a_cap_above_free_memory(probe, size: dict, expected: int | None) -> None:
    """A cap between the node's free and total memory is never allocated when
    an explicit size below it is: the check before loading counts what will
    be allocated, not the cap."""
    available, total = node_memory()
    cap = total - 16 * MiB
    assert available < cap < total  # the premise: the cap alone cannot fit
    assert (expected or 0) < available // 2  # ... the explicit size can
    result, log = probe(kv_cache_max_memory=cap, **size)
    assert result["ok"], f"{result.get('error_type')}: {result.get('error')}\n{log[-3000:]}"
    if expected is None:
        assert result["num_gpu_blocks"] == 64
        expected = 64 * block_bytes(result)
    assert result["kv_cache_bytes"] == [expected]  # measured in the worker
    assert "cannot fit on the host memory node" not in log
