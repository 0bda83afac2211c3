"""A cap too small for any KV cache block is refused as the engine
arguments are resolved, before weights load: ``--kv-cache-max-memory 8 G``
unquoted gives a cap of 8 bytes (the shell splits it, and ``G`` becomes
another argument), which used to fail only after the weights had loaded."""

from __future__ import annotations

import pytest

from vllm_kv_cache_limit import register
from vllm_kv_cache_limit.logic import envs
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.sizes import parse_size


@pytest.fixture
def engine_args(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(envs.MAX_MEMORY, raising=False)
    register()
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def test_a_cap_of_eight_bytes_is_refused_before_anything_loads(engine_args, tiny_model: str) -> None:
    """``create_engine_config`` runs in the first process, before any engine
    core or worker starts: refused there, no weights have loaded."""
    with pytest.raises(KVCacheMaxMemoryError) as info:
        engine_args(model=tiny_model, kv_cache_max_memory="8").create_engine_config()
    message = str(info.value)
    assert "--kv-cache-max-memory 8B (8 bytes)" in message, message
    assert "one KV cache block" in message, message
    # How the cap came to be 8 bytes, and what to write instead.
    assert "--kv-cache-max-memory '8 G'" in message and "8G" in message, message
    engine_args(model=tiny_model, kv_cache_max_memory="8G").create_engine_config()  # what it suggests is accepted


def test_the_least_cap_is_below_any_real_block_and_above_a_bare_number() -> None:
    from vllm_kv_cache_limit.logic.cap_decision import check_cap_holds_a_block, smallest_block_bytes

    # vLLM's smallest block: 16 tokens (the smallest default block size), K and V,
    # one layer, one KV head of 8 dimensions, fp8: 256 bytes.
    assert smallest_block_bytes(None) == 256
    assert smallest_block_bytes(1) == 16
    # The smallest cap a test gives an engine (too small for one request, not for a block).
    check_cap_holds_a_block(parse_size("300K"), None)
    check_cap_holds_a_block(256, None)
    for cap in (1, 8, 255):
        with pytest.raises(KVCacheMaxMemoryError, match="quote"):
            check_cap_holds_a_block(cap, None)
