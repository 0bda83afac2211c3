"""The cap decision as pure functions: budget, cap, explicit size, override."""

from __future__ import annotations

import pytest

from vllm_kv_cache_limit.policy import (
    ENV_VAR,
    CapDecision,
    KVCacheMaxMemoryError,
    cap_block_override,
    cap_budget,
    cap_explicit_size,
    check_cap_within_free,
    check_cap_within_total,
    resolve_cap,
    too_small_message,
)
from vllm_kv_cache_limit.sizes import parse_size

MiB = 2**20
GiB = 2**30


@pytest.mark.parametrize(
    ("budget", "cap", "kv_bytes", "bound"),
    [
        (10 * GiB, 8 * GiB, 8 * GiB, True),
        (4 * GiB, 8 * GiB, 4 * GiB, False),
        (8 * GiB, 8 * GiB, 8 * GiB, False),
        (0, 8 * GiB, 0, False),
    ],
)
def test_budget_vs_cap(budget: int, cap: int, kv_bytes: int, bound: bool) -> None:
    decision = cap_budget(budget, cap)
    assert decision == CapDecision(budget=budget, cap=cap)
    assert decision.kv_bytes == kv_bytes
    assert decision.bound is bound


def test_no_cap_no_decision() -> None:
    assert cap_budget(10 * GiB, None) is None


@pytest.mark.parametrize(
    ("explicit", "cap", "expected", "warns"),
    [
        (None, 8 * GiB, None, False),
        (4 * GiB, 8 * GiB, 4 * GiB, False),
        (8 * GiB, 8 * GiB, 8 * GiB, False),
        (16 * GiB, 8 * GiB, 8 * GiB, True),
        (16 * GiB, None, 16 * GiB, False),
    ],
)
def test_explicit_size_vs_cap(explicit: int | None, cap: int | None, expected: int | None, warns: bool) -> None:
    size, warning = cap_explicit_size(explicit, cap)
    assert size == expected
    assert (warning is not None) is warns
    if warning:
        assert str(explicit) in warning and str(cap) in warning


@pytest.mark.parametrize(
    ("override", "fit", "expected", "warns"),
    [
        (None, 128, None, False),
        (100, 128, 100, False),
        (128, 128, 128, False),
        (1000, 128, 128, True),
    ],
)
def test_override_vs_cap(override: int | None, fit: int, expected: int | None, warns: bool) -> None:
    blocks, warning = cap_block_override(override, fit, 16 * MiB)
    assert blocks == expected
    assert (warning is not None) is warns
    if warning:
        assert "num_gpu_blocks_override=1000" in warning and "128 blocks" in warning


def test_resolve_cap_argument_wins_over_environment() -> None:
    assert resolve_cap("8G", "4G") == 8 * GiB
    assert resolve_cap(None, "4G") == 4 * GiB
    assert resolve_cap(None, None) is None
    assert resolve_cap(None, "  ") is None


def test_resolve_cap_bad_environment_names_the_variable() -> None:
    with pytest.raises(ValueError, match=rf"{ENV_VAR}: Invalid size '8 gigs'"):
        resolve_cap(None, "8 gigs")


def test_total_check() -> None:
    check_cap_within_total(8 * GiB, 8 * GiB, "cuda:0")
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_within_total(100 * GiB, 80 * GiB, "cuda:0")
    message = str(info.value)
    assert "--kv-cache-max-memory 100GiB" in message and "cuda:0" in message
    assert "80.00 GiB" in message
    # The value it suggests fits.
    suggested = message.rsplit("--kv-cache-max-memory ", 1)[1].rstrip(".")
    assert parse_size(suggested) <= 80 * GiB


@pytest.mark.parametrize(
    ("cap", "free", "fails"),
    [
        (8 * GiB, 8 * GiB, False),
        (int(8 * GiB * 1.01), 8 * GiB, False),  # within the 1% tolerance
        (int(8 * GiB * 1.01) + 1, 8 * GiB, True),
        (9 * GiB, 8 * GiB, True),
    ],
)
def test_free_check_tolerance(cap: int, free: int, fails: bool) -> None:
    if not fails:
        check_cap_within_free(cap, free, 80 * GiB, "cuda:0")
        return
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_within_free(cap, free, 80 * GiB, "cuda:0")
    message = str(info.value)
    assert "--kv-cache-max-memory" in message and "8.00 GiB free of 80.00 GiB total" in message
    suggested = message.rsplit("--kv-cache-max-memory ", 1)[1].rstrip(".")
    assert parse_size(suggested) <= free


def test_too_small_message_names_flag_need_and_fit() -> None:
    message = too_small_message(256 * 1024, 512 * 1024, 128 * 1024, 512, 128)
    assert message.startswith("--kv-cache-max-memory 256KiB")
    assert "max_model_len=512" in message and "524288 bytes" in message
    assert "--max-model-len 128" in message
    # The smallest cap that works holds the request and the reserved block.
    assert "--kv-cache-max-memory 640KiB" in message


def test_too_small_message_without_estimate() -> None:
    message = too_small_message(1024, 512 * 1024, 128 * 1024, 512, 0)
    assert "--max-model-len" not in message
    assert "at least --kv-cache-max-memory 640KiB" in message
