"""KV connectors that touch KV blocks after vLLM's scheduler freed them make
a lower run-time limit refuse on vLLM 0.34's extensible KV cache (its
memory above the limit would be unmapped under their copies); the others
leave it allowed. The engine configs are vLLM's own, built from the
engine arguments a user gives (``EngineArgs.create_engine_config``), and
the refusal is what the engine core answers (``kv_cache_limit_set``)."""

from __future__ import annotations

from typing import Any

import pytest
import vllm.v1.engine.core

from vllm_kv_cache_limit.compat import installed_vllm_version

if not hasattr(vllm.v1.engine.core, "finalize_extensible_kv_cache"):
    pytest.skip(
        f"vLLM {installed_vllm_version()} has no extensible KV cache (new in vLLM 0.34)", allow_module_level=True
    )

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from tests.conftest import TEST_MAX_MODEL_LEN  # noqa: E402
from tests.cuda_wheel import test_resize_scheduler as sched  # noqa: E402
from tests.cuda_wheel.conftest import FakeGPU  # noqa: E402
from vllm_kv_cache_limit.hooks.runtime import extensible_kv_cache  # noqa: E402
from vllm_kv_cache_limit.logic import limit_math  # noqa: E402


def _config(tiny_model: str, max_model_len: int = TEST_MAX_MODEL_LEN, **kwargs: Any) -> Any:
    config = EngineArgs(
        model=tiny_model,
        max_model_len=max_model_len,
        enable_extensible_kv_cache=True,
        kv_cache_max_memory="64M",
        **kwargs,
    ).create_engine_config()
    assert config.cache_config.enable_extensible_kv_cache
    return config


def _multi(*children: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": list(children)}
    )


OFFLOADING = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
EXAMPLE = {
    "kv_connector": "ExampleConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/nonexistent"},
}


def test_kv_offloading_size_refuses_a_lower_limit(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """``--kv-offloading-size`` selects the OffloadingConnector, which stores
    a finished request's blocks from the step after the scheduler freed them."""
    config = _config(tiny_model, kv_offloading_size=1.0)
    assert config.kv_transfer_config.kv_connector == "OffloadingConnector"  # vLLM's choice, the premise
    assert not config.kv_transfer_config.registers_kv_cache_memory()  # not refused for that
    reason = extensible_kv_cache.refusal(config)
    assert reason is not None and "OffloadingConnector" in reason and "--kv-offloading-size" in reason, reason
    assert "freed" in reason


def test_offloading_in_a_multi_connector_refuses(fake_gpu: FakeGPU, tiny_model: str) -> None:
    config = _config(tiny_model, kv_transfer_config=_multi(EXAMPLE, OFFLOADING))
    reason = extensible_kv_cache.refusal(config)
    assert reason is not None and "OffloadingConnector" in reason, reason


def test_an_out_of_tree_connector_refuses_naming_its_module(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """A connector loaded from a module outside vLLM (not audited here): fail closed."""
    child = {**EXAMPLE, "kv_connector_module_path": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"}
    config = _config(tiny_model, kv_transfer_config=_multi(child))
    reason = extensible_kv_cache.refusal(config)
    assert reason is not None and "ExampleConnector" in reason and child["kv_connector_module_path"] in reason


@pytest.mark.parametrize(
    ("connector", "extra", "refused"),
    [
        ("LMCacheConnectorV1", {}, True),
        ("LMCacheConnectorV1", {"use_native": True}, False),
        ("FlexKVConnectorV1", {}, True),
    ],
)
def test_connectors_whose_copies_are_another_package_refuse(
    fake_gpu: FakeGPU, tiny_model: str, connector: str, extra: dict[str, Any], refused: bool
) -> None:
    """The lmcache and flexkv packages' code decides when blocks are
    copied: not audited, so refused; vLLM's own LMCache adapter saves within the step."""
    transfer = KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    config = _config(tiny_model)
    config.kv_transfer_config = transfer  # as the engine arguments set it; the packages are not installed here
    reason = extensible_kv_cache.refusal(config)
    assert (reason is not None) == refused, reason
    if refused:
        assert connector in reason and "outside vLLM" in reason


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_transfer_config": KVTransferConfig(**EXAMPLE)},
        {"kv_offloading_size": 1.0, "env": "simple"},  # SimpleCPUOffloadConnector, eager: holds the blocks it stores
    ],
    ids=["ExampleConnector", "SimpleCPUOffloadConnector-eager"],
)
def test_connectors_that_hold_or_finish_with_blocks_before_they_are_freed_allow_it(
    fake_gpu: FakeGPU, tiny_model: str, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any]
) -> None:
    kwargs = dict(kwargs)
    if kwargs.pop("env", None) == "simple":
        monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "1")
    config = _config(tiny_model, **kwargs)
    assert config.kv_transfer_config is not None
    assert extensible_kv_cache.refusal(config) is None


def test_the_engine_core_refuses_the_lower_limit_and_keeps_its_own(fake_gpu: FakeGPU, tiny_model: str) -> None:
    """What a user of ``set_kv_cache_max_memory`` (or the autoscaler) gets:
    an error naming the connector and what to do; the limit is unchanged."""
    core = sched._engine_core(sched._scheduler(tiny_model))
    core.vllm_config = _config(tiny_model, sched.MAX_MODEL_LEN, kv_offloading_size=1.0)
    status = core.kv_cache_limit_set(sched.LIMIT * sched.BYTES_PER_BLOCK, "drain")
    assert limit_math.is_error(status), status
    assert "OffloadingConnector" in status["error"] and "--no-enable-extensible-kv-cache" in status["error"]
    assert max(sched._free_ids(core)) == sched.NUM_BLOCKS - 1  # nothing withheld


def test_lazy_simple_cpu_offload_refuses(fake_gpu: FakeGPU, tiny_model: str) -> None:
    lazy = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both"}
    lazy["kv_connector_extra_config"] = {"lazy_offload": True}  # type: ignore[assignment]
    for transfer in (KVTransferConfig(**lazy), _multi(EXAMPLE, lazy)):
        reason = extensible_kv_cache.refusal(_config(tiny_model, kv_transfer_config=transfer))
        assert reason is not None and "lazy_offload" in reason, reason
