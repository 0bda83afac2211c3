"""The upstream patches (``upstream/``): the 0.33.0 patch is the 0.32.0 one
where vLLM's code did not move, the 0.34.0 patch the 0.33.0 one plus the
extensible KV cache's final size; each difference is listed here."""

from __future__ import annotations

import collections
import re

from tests.conftest import REPO

UPSTREAM = REPO / "upstream"
MOVED = {"vllm/v1/core/kv_cache_utils.py": "vllm/v1/core/kv_cache_planning.py"}
"""0.33.0 moved ``get_kv_cache_configs`` and ``_check_enough_kv_cache_memory``."""

KV_CACHE_TEST = "tests/v1/core/test_kv_cache_max_memory.py"
PLANNING = "vllm/v1/core/kv_cache_planning.py"
CPU_WORKER = "vllm/v1/worker/cpu_worker.py"

DIFFERENCES = {
    # The test imports the moved module; 0.33.0's get_kv_cache_configs takes
    # the KV cache groups the engine core now builds first.
    (KV_CACHE_TEST, "0.32.0", "from vllm.v1.core import kv_cache_utils"),
    (KV_CACHE_TEST, "0.32.0", "from vllm.v1.core.kv_cache_utils import get_kv_cache_configs"),
    (KV_CACHE_TEST, "0.32.0", "return get_kv_cache_configs(vllm_config, specs, [budget]), vllm_config"),
    (KV_CACHE_TEST, "0.32.0", 'kv_cache_utils.logger, "warning", lambda msg, *a: warnings.append(msg % a)'),
    (KV_CACHE_TEST, "0.32.0", 'kv_cache_utils.logger, "info", lambda msg, *a, **k: lines.append(msg % a)'),
    (KV_CACHE_TEST, "0.33.0", "from vllm.v1.core import kv_cache_planning"),
    (KV_CACHE_TEST, "0.33.0", "from vllm.v1.core.kv_cache_planning import ("),
    (KV_CACHE_TEST, "0.33.0", "get_global_kv_cache_groups,"),
    (KV_CACHE_TEST, "0.33.0", "get_kv_cache_configs,"),
    (KV_CACHE_TEST, "0.33.0", ")"),
    (KV_CACHE_TEST, "0.33.0", "groups = get_global_kv_cache_groups(vllm_config, specs)"),
    (KV_CACHE_TEST, "0.33.0", "return get_kv_cache_configs(vllm_config, specs, [budget], groups), vllm_config"),
    (KV_CACHE_TEST, "0.33.0", 'kv_cache_planning.logger, "warning", lambda msg, *a: warnings.append(msg % a)'),
    (KV_CACHE_TEST, "0.33.0", 'kv_cache_planning.logger, "info", lambda msg, *a, **k: lines.append(msg % a)'),
    # 0.33.0 sizes blocks through the pluggable KVCacheConfigBuilder: the cap
    # uses the allocation's own divisor; get_kv_cache_capacity stayed behind.
    (PLANNING, "0.32.0", "_pool_bytes_per_block(vllm_config, groups)"),
    (PLANNING, "0.33.0", "_pool_bytes_per_block_from_builder(builder, vllm_config, groups)"),
    (PLANNING, "0.33.0", "from vllm.v1.core.kv_cache_utils import _kv_cache_device_name, get_kv_cache_capacity"),
    # 0.33.0 dropped the CPU worker's start-up gate in __init__: the patch
    # reads the node's available memory itself and keeps only the ceiling.
    (CPU_WORKER, "0.32.0", "elif ("),
    (CPU_WORKER, "0.33.0", "available_memory = memory_status.available_memory"),
    (CPU_WORKER, "0.33.0", "if ("),
}


ARGS_TEST = "tests/engine/test_kv_cache_max_memory_args.py"
WORKER_UTILS = "vllm/v1/worker/utils.py"
CACHE_CONFIG = "vllm/config/cache.py"

_CEILING_LOG_033 = {
    # 0.33.0 logged the ceiling in both workers; 0.34.0 applies it as min(request,
    # free) without the INFO line (the patch stays under 300 lines).
    '"--gpu-memory-utilization %s asks for %s GiB of device %s, but %s GiB "',
    '"a ceiling, so this instance requests what is free.",',
    '"is free at start-up; with --kv-cache-max-memory the utilization is "',
    ")",
    "):",
    "and cache_config.kv_cache_max_memory is not None",
    "cache_config.gpu_memory_utilization,",
    "format_gib(init_snapshot.free_memory),",
    "format_gib(requested_memory),",
    "if (",
    "init_snapshot.device_,",
    "init_snapshot.free_memory < requested_memory",
    "logger.info(",
    "return init_snapshot.free_memory",
}
_CPU_CEILING_LOG_033 = {
    '"--gpu-memory-utilization %s asks for %s GiB of memory node %s, "',
    '"but %s GiB is free at start-up; with --kv-cache-max-memory the "',
    '"utilization is a ceiling, so this instance requests what is free.",',
    ")",
    "):",
    "and self.requested_cpu_memory > available_memory",
    "and vllm_config.cache_config.kv_cache_max_memory is not None",
    "format_gib(available_memory),",
    "format_gib(self.requested_cpu_memory),",
    "if (",
    "logger.info(",
    "memory_fraction,",
    "memory_node,",
    "self.requested_cpu_memory = available_memory",
    "vllm_config.cache_config.kv_cache_memory_bytes is None",
}

DIFFERENCES_034 = {
    # 0.34.0's utilization may be None: vLLM resolves it
    # (`resolved_gpu_memory_utilization`: 1.0 with the extensible KV cache).
    (WORKER_UTILS, "0.33.0", "wanted = math.ceil(total_memory * cache_config.gpu_memory_utilization)"),
    (WORKER_UTILS, "0.34.0", "wanted = math.ceil(total_memory * cache_config.resolved_gpu_memory_utilization)"),
    (PLANNING, "0.33.0", 'f"{cache_config.gpu_memory_utilization} is smaller)"'),
    (PLANNING, "0.34.0", 'f"{cache_config.resolved_gpu_memory_utilization} is smaller)"'),
    # The ceiling without its INFO line.
    *((WORKER_UTILS, "0.33.0", line) for line in _CEILING_LOG_033),
    (WORKER_UTILS, "0.34.0", "# Under a cap the utilization is a ceiling: request at most what is free."),
    (WORKER_UTILS, "0.34.0", "if cache_config.kv_cache_max_memory is not None:"),
    (WORKER_UTILS, "0.34.0", "requested_memory = min(requested_memory, init_snapshot.free_memory)"),
    *((CPU_WORKER, "0.33.0", line) for line in _CPU_CEILING_LOG_033),
    (CPU_WORKER, "0.34.0", "# Under a cap the utilization is a ceiling: at most what is free."),
    (CPU_WORKER, "0.34.0", "if vllm_config.cache_config.kv_cache_max_memory is not None:"),
    (CPU_WORKER, "0.34.0", "self.requested_cpu_memory = min(self.requested_cpu_memory, available_memory)"),
    # The field's docstring (the CLI help) says what the cap does to the extensible KV cache.
    (CACHE_CONFIG, "0.33.0", "device's total memory, above what the device can still give this"),
    (CACHE_CONFIG, "0.33.0", 'instance, or too small for one request of `max_model_len`."""'),
    (CACHE_CONFIG, "0.33.0", "processes. Start-up fails, naming the cap, when the cap is above the"),
    (CACHE_CONFIG, "0.34.0", '`max_model_len`."""'),
    (CACHE_CONFIG, "0.34.0", "cap, when the cap is above the device's total memory, above what the"),
    (CACHE_CONFIG, "0.34.0", "capacity and the size committed after warmup. Start-up fails, naming the"),
    (CACHE_CONFIG, "0.34.0", "device can still give this instance, or too small for one request of"),
    (CACHE_CONFIG, "0.34.0", "processes. With the extensible KV cache, the cap bounds both the reserved"),
    # 0.34.0 imports update_kv_cache_capacity beside them (a parenthesized import).
    (PLANNING, "0.33.0", "from vllm.v1.core.kv_cache_utils import _kv_cache_device_name, get_kv_cache_capacity"),
    (PLANNING, "0.34.0", "get_kv_cache_capacity,"),
    # finalize_extensible_kv_cache: the cap on the size settled after warmup, one INFO line.
    (PLANNING, "0.34.0", '"%d blocks per device, under --kv-cache-max-memory %s (%d blocks).",'),
    (PLANNING, "0.34.0", '"KV cache max memory: the extensible KV cache settles after warmup at "'),
    (PLANNING, "0.34.0", "# `kv_cache_max_memory` bounds the reservation; the final size too."),
    (PLANNING, "0.34.0", ")"),
    (PLANNING, "0.34.0", "]"),
    (PLANNING, "0.34.0", "_pool_bytes_per_block_from_builder(builder, vllm_config, c.kv_cache_groups)"),
    (PLANNING, "0.34.0", "builder = get_kv_cache_config_builder(vllm_config)"),
    (PLANNING, "0.34.0", "cap = vllm_config.cache_config.kv_cache_max_memory"),
    (PLANNING, "0.34.0", "cap_blocks = cap // max(per_block, default=1)"),
    (PLANNING, "0.34.0", "cap_blocks,"),
    (PLANNING, "0.34.0", "for c in kv_cache_configs"),
    (PLANNING, "0.34.0", "format_binary_size(cap),"),
    (PLANNING, "0.34.0", "if c.kv_cache_groups"),
    (PLANNING, "0.34.0", "if cap is not None:"),
    (PLANNING, "0.34.0", "logger.info("),
    (PLANNING, "0.34.0", "num_blocks = min(num_blocks, cap_blocks)"),
    (PLANNING, "0.34.0", "num_blocks,"),
    (PLANNING, "0.34.0", "per_block = ["),
}
"""Between the 0.33.0 and 0.34.0 patches, outside the tests."""

TEST_LINES_REPLACED_034 = {
    # Parametrized over the extensible KV cache.
    (KV_CACHE_TEST, "(config,), _ = _configs(model_dir, GiB, kv_cache_max_memory=cap)"),
    (KV_CACHE_TEST, "def test_cap_bounds_the_block_count(model_dir, cap):"),
    # The module docstring names finalize_extensible_kv_cache too.
    (KV_CACHE_TEST, 'into KV cache blocks (`get_kv_cache_configs`)."""'),
    # vLLM's own too-small message names gpu_memory_utilization only without
    # the extensible KV cache in 0.34.0.
    (KV_CACHE_TEST, 'with pytest.raises(ValueError, match="gpu_memory_utilization"):'),
}
"""The 0.33.0 patch's test lines the 0.34.0 patch does not have (it adds tests)."""


def added_lines(version: str) -> dict[str, collections.Counter[str]]:
    """Per file the patch writes (its 0.33.0 name), the non-blank lines it adds."""
    added: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    current = None
    for line in (UPSTREAM / f"vllm-{version}.patch").read_text().splitlines():
        if match := re.match(r"^\+\+\+ b/(\S+)", line):
            current = MOVED.get(match[1], match[1])
        elif current and line.startswith("+") and line[1:].strip():
            added[current][line[1:].strip()] += 1
    return added


def test_both_patches_add_the_same_lines_except_where_vllm_moved_code() -> None:
    old, new = added_lines("0.32.0"), added_lines("0.33.0")
    assert sorted(old) == sorted(new)  # the same files, by their 0.33.0 names
    found = set()
    for name in old:
        found |= {(name, "0.32.0", line) for line in old[name] - new[name]}
        found |= {(name, "0.33.0", line) for line in new[name] - old[name]}
    assert found == DIFFERENCES


def test_the_034_patch_is_the_033_one_plus_the_extensible_kv_cache() -> None:
    old, new = added_lines("0.33.0"), added_lines("0.34.0")
    assert sorted(old) == sorted(new)
    found, replaced = set(), set()
    for name in old:
        if name.startswith("tests/"):
            replaced |= {(name, line) for line in old[name] - new[name]}
            continue
        found |= {(name, "0.33.0", line) for line in old[name] - new[name]}
        found |= {(name, "0.34.0", line) for line in new[name] - old[name]}
    assert found == DIFFERENCES_034
    assert replaced == TEST_LINES_REPLACED_034
    for name in (KV_CACHE_TEST, ARGS_TEST):  # every 0.33.0 test is still there
        tests = {line for line in old[name] if line.startswith("def test_")}
        kept = {line.split("(")[0] for line in new[name] if line.startswith("def test_")}
        assert {line.split("(")[0] for line in tests} <= kept, name


def test_the_034_patch_stays_under_300_lines_outside_the_tests() -> None:
    counted = sum(sum(lines.values()) for name, lines in added_lines("0.34.0").items() if not name.startswith("tests/"))
    assert counted < 300


def test_the_patches_touch_only_vllm_and_new_test_files() -> None:
    for version in ("0.32.0", "0.33.0", "0.34.0"):
        text = (UPSTREAM / f"vllm-{version}.patch").read_text()
        for old, new in re.findall(r"^--- (\S+)\n\+\+\+ (\S+)", text, flags=re.M):
            assert old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:], (version, old, new)
            assert new.startswith(("b/vllm/", "b/tests/")), (version, new)
        created = re.findall(r"^diff -ruN a/(tests/\S+)", text, flags=re.M)
        assert created == ["tests/engine/test_kv_cache_max_memory_args.py", KV_CACHE_TEST], version
        assert not re.search(r"^\+\+\+ .*\t", text, flags=re.M), "timestamps in the headers"
