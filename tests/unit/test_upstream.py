"""The upstream patches (``upstream/``): the 0.33.0 patch is the 0.32.0 one
where vLLM's code did not move, and each difference is listed here."""

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


def test_the_patches_touch_only_vllm_and_new_test_files() -> None:
    for version in ("0.32.0", "0.33.0"):
        text = (UPSTREAM / f"vllm-{version}.patch").read_text()
        for old, new in re.findall(r"^--- (\S+)\n\+\+\+ (\S+)", text, flags=re.M):
            assert old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:], (version, old, new)
            assert new.startswith(("b/vllm/", "b/tests/")), (version, new)
        created = re.findall(r"^diff -ruN a/(tests/\S+)", text, flags=re.M)
        assert created == ["tests/engine/test_kv_cache_max_memory_args.py", KV_CACHE_TEST], version
        assert not re.search(r"^\+\+\+ .*\t", text, flags=re.M), "timestamps in the headers"
