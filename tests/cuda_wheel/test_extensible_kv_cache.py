"""vLLM 0.34's extensible KV cache under a cap, with vLLM's own planning code:
``get_kv_cache_configs`` decides the reservation (the plugin bounds it by
the cap) and ``finalize_extensible_kv_cache`` commits the smaller of it and
what every rank measured after warmup. The engine core calls both through
``vllm.v1.engine.core``, where the plugin wraps them; the workers' warmup
readings (``CompilationTimes.num_kv_blocks``) are given by the test."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import vllm.v1.engine.core

from vllm_kv_cache_limit.compat import installed_vllm_version

if not hasattr(vllm.v1.engine.core, "finalize_extensible_kv_cache"):
    # Decided from the installed vLLM: the extensible KV cache is new in 0.34.
    pytest.skip(
        f"vLLM {installed_vllm_version()} has no extensible KV cache "
        "(no vllm.v1.engine.core.finalize_extensible_kv_cache; new in vLLM 0.34)",
        allow_module_level=True,
    )

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.worker.worker_base import CompilationTimes  # noqa: E402

from tests.conftest import TEST_MAX_MODEL_LEN  # noqa: E402
from tests.cuda_wheel.conftest import FakeGPU, GiB, attention_specs  # noqa: E402
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError  # noqa: E402

MiB = 1 << 20


def _plan(tiny_model: str, cap: str | None, available: int, **kwargs):
    """The engine config, its specs and vLLM's configs for ``available``
    bytes, as the engine core computes them before warmup."""
    import vllm.v1.engine.core as engine_core

    args = {"kv_cache_max_memory": cap} if cap is not None else {}
    config = EngineArgs(
        model=tiny_model, max_model_len=TEST_MAX_MODEL_LEN, enable_extensible_kv_cache=True, **args, **kwargs
    ).create_engine_config()
    assert config.cache_config.enable_extensible_kv_cache
    spec, specs, groups = attention_specs(config)
    configs = engine_core.get_kv_cache_configs(config, specs, [available], groups)
    scheduler_config = configs[0].__class__(
        num_blocks=configs[0].num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=configs[0].kv_cache_groups,
    )
    return config, configs, scheduler_config, spec


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _finalize(config: Any, configs: Any, scheduler_config: Any, measured: list[Any]) -> tuple[int, list[str]]:
    """vLLM's ``finalize_extensible_kv_cache``, as the engine core calls it,
    and the plugin's final-size lines it logged."""
    import vllm.v1.engine.core as engine_core

    handler = _Lines()
    logger = logging.getLogger("vllm.plugins.kv_cache_limit")
    logger.addHandler(handler)
    try:
        num_blocks = engine_core.finalize_extensible_kv_cache(config, configs, scheduler_config, measured)
    finally:
        logger.removeHandler(handler)
    return num_blocks, [line for line in handler.lines if "settled after warmup" in line]


def _block_bytes(config, spec) -> int:
    return spec.page_size_bytes * config.model_config.get_num_layers(config.parallel_config)


def test_the_cap_bounds_the_reservation_and_the_committed_size_and_the_final_size_is_logged(
    fake_gpu: FakeGPU, tiny_model: str
) -> None:
    """8 GiB free, cap 64 MiB: vLLM reserves the cap's blocks; warmup leaves
    far more, so the cap binds and the INFO line says so."""

    config, configs, scheduler_config, spec = _plan(tiny_model, "64M", 8 * GiB)
    reserved = scheduler_config.num_blocks
    assert reserved * _block_bytes(config, spec) <= 64 * MiB
    measured = [CompilationTimes(1.0, 0.0, num_kv_blocks=reserved * 40)]
    num_blocks, lines = _finalize(config, configs, scheduler_config, measured)
    assert num_blocks == reserved
    assert config.cache_config.num_gpu_blocks == reserved
    assert max(t.size for c in configs for t in c.kv_cache_tensors) * len(configs[0].kv_cache_tensors) <= 64 * MiB
    assert len(lines) == 1 and f"at {reserved} blocks" in lines[0] and "the cap binds" in lines[0], lines


def test_warmup_leaving_less_than_the_cap_commits_what_vllm_measured(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """The block pool keeps the cap's reservation (a run-time limit can grow
    to it later); the engine core starts at the blocks vLLM measured, which
    the workers commit (``tests/cuda_wheel/test_extensible_resize.py``)."""
    from vllm_kv_cache_limit.hooks.cap import engine_core as cap_engine_core

    config, configs, scheduler_config, _ = _plan(tiny_model, "64M", 8 * GiB)
    reserved = scheduler_config.num_blocks
    sizes = [t.size for c in configs for t in c.kv_cache_tensors]
    measured = [CompilationTimes(1.0, 0.0, num_kv_blocks=reserved // 2)]
    num_blocks, lines = _finalize(config, configs, scheduler_config, measured)
    assert num_blocks == reserved == scheduler_config.num_blocks == config.cache_config.num_gpu_blocks
    assert [c.num_blocks for c in configs] == [reserved] and [
        t.size for c in configs for t in c.kv_cache_tensors
    ] == sizes
    assert cap_engine_core._active.committed == reserved // 2  # the limit the engine core starts at
    cap_engine_core._active.committed = None
    (line,) = lines
    assert f"at {reserved // 2} blocks" in line and f"vLLM measured {reserved // 2} blocks" in line


def test_without_a_cap_vllm_runs_untouched(fake_gpu: FakeGPU, tiny_model: str) -> None:

    config, configs, scheduler_config, _ = _plan(tiny_model, None, 256 * MiB)
    reserved = scheduler_config.num_blocks
    measured = [CompilationTimes(1.0, 0.0, num_kv_blocks=reserved - 3)]
    assert _finalize(config, configs, scheduler_config, measured) == (reserved - 3, [])


def test_auto_fit_after_warmup_names_the_cap_when_the_cap_binds(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """``--max-model-len auto``: vLLM fits the context to the capacity again
    after warmup; with a cap so small that not one token fits, its refusal
    names the cap, not ``gpu_memory_utilization``."""
    import vllm.v1.engine.core as engine_core

    config, configs, scheduler_config, _ = _plan(tiny_model, "64M", 8 * GiB)
    config.model_config.original_max_model_len = -1
    scheduler_config.num_blocks = 1  # only the null block: no room for a token
    measured = [CompilationTimes(1.0, 0.0, num_kv_blocks=1000)]
    with pytest.raises(KVCacheMaxMemoryError, match="--kv-cache-max-memory"):
        engine_core.finalize_extensible_kv_cache(config, configs, scheduler_config, measured)
