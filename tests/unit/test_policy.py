"""The cap decision as pure functions: budget, cap, explicit size, override."""

from __future__ import annotations

from fractions import Fraction

import pytest

from vllm_kv_cache_limit.logic.cap_decision import (
    CAP_TOLERANCE,
    ENV_VAR,
    CapDecision,
    KVCacheMaxMemoryError,
    cap_block_override,
    cap_explicit_size,
    check_cap_fits_before_load,
    check_cap_within_instance,
    check_cap_within_total,
    check_explicit_size_within_free,
    kv_bytes_before_load,
    resolve_cap,
    tolerance_bytes,
    too_small_message,
    utilization_ceiling,
)
from vllm_kv_cache_limit.logic.sizes import parse_size

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
    decision = CapDecision(budget=budget, cap=cap)
    assert decision.kv_bytes == kv_bytes
    assert decision.bound is bound


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
    ("size", "cap", "free", "fails"),
    [
        (8 * GiB, 8 * GiB, 8 * GiB, False),
        (8 * GiB + 1, 16 * GiB, 8 * GiB, True),  # no tolerance: vLLM allocates all of it
        (8 * GiB + 1, 8 * GiB + 1, 8 * GiB, True),  # none either when the cap sets the size
        (4 * GiB, 130 * GiB, 8 * GiB, False),  # min(explicit, cap) is what counts
        (9 * GiB, 9 * GiB, 8 * GiB, True),
    ],
)
def test_explicit_size_against_free_memory(size: int, cap: int, free: int, fails: bool) -> None:
    if not fails:
        check_explicit_size_within_free(size, cap, free, 80 * GiB, "cuda:0")
        return
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_explicit_size_within_free(size, cap, free, 80 * GiB, "cuda:0")
    message = str(info.value)
    assert f"The KV cache of {size} bytes" in message
    assert "8.00 GiB free of 80.00 GiB total" in message
    assert ("--kv-cache-memory-bytes" in message) is (size != cap)
    suggested = message.rsplit("--kv-cache-max-memory ", 1)[1].rstrip(".")
    assert parse_size(suggested) <= free


@pytest.mark.parametrize(
    ("total", "free", "utilization", "external", "slack"),
    [
        (80 * GiB, 20 * GiB, 0.9, 0, 0),
        (80 * GiB + 12345, 20 * GiB + 777, 0.9, 0, 0),
        (9_005_272 * 1024, 7_290_000_000, 0.92, 0, 72_900_000),
        (80 * GiB, 20 * GiB, 0.9, 10 * GiB, 0),
        (80 * GiB, 3, 0.5, 0, 0),
    ],
)
def test_utilization_ceiling_asks_for_what_is_free(
    total: int, free: int, utilization: float, external: int, slack: int
) -> None:
    import math

    assert math.ceil(total * utilization) - external > free  # the premise: vLLM would refuse
    ceiling = utilization_ceiling(total, free, utilization, external, slack)
    assert ceiling is not None and 0 <= ceiling < utilization
    requested = math.ceil(total * ceiling) - external
    assert requested <= free - slack  # vLLM's gate passes
    assert requested >= free - slack - 2  # and asks for (nearly) all of it


def test_utilization_ceiling_leaves_a_free_request_alone() -> None:
    assert utilization_ceiling(80 * GiB, 72 * GiB, 0.9) is None
    assert utilization_ceiling(80 * GiB, 30 * GiB, 0.3) is None  # an explicit lower utilization
    assert utilization_ceiling(80 * GiB, 20 * GiB, 0.9, external=60 * GiB) is None


def test_cap_within_instance() -> None:
    check_cap_within_instance(8 * GiB, 8 * GiB, 20 * GiB, 12 * GiB, "cuda:0")
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_within_instance(10 * GiB, 6 * GiB, 20 * GiB, 14 * GiB, "cuda:0")
    message = str(info.value)
    assert message.startswith("--kv-cache-max-memory 10GiB (10737418240 bytes, 10.00 GiB)")
    assert "what the cuda:0 can still give this instance" in message
    assert "20.00 GiB (21474836480 bytes) was free at start-up" in message
    assert "needs 14.00 GiB (15032385536 bytes) besides its KV cache" in message
    assert "leaves 6.00 GiB" in message
    assert "--kv-cache-max-memory 6GiB" in message
    with pytest.raises(KVCacheMaxMemoryError, match="Nothing is left for the KV cache"):
        check_cap_within_instance(1 * GiB, -5, 2 * GiB, 2 * GiB, "cuda:0")


def test_the_tolerance_is_one_percent_rounded_down() -> None:
    assert Fraction(1, 100) == CAP_TOLERANCE
    assert tolerance_bytes(6 * 10**9) == 6 * 10**7
    assert tolerance_bytes(199) == 1  # 1.99 bytes: whole bytes only
    assert tolerance_bytes(0) == tolerance_bytes(-5) == 0  # nothing to give, nothing to round


def test_cap_within_instance_tolerates_one_percent_above_the_budget() -> None:
    """Rounding and drift between readings: a cap up to 1% above the budget
    is accepted (the KV cache gets the budget; the excess is returned for
    the INFO line), a byte more is refused as any cap above it was."""
    budget = 6 * 10**9
    assert check_cap_within_instance(budget, budget, 20 * GiB, 14 * GiB, "cuda:0") == 0
    assert check_cap_within_instance(budget - 1, budget, 20 * GiB, 14 * GiB, "cuda:0") == 0
    assert check_cap_within_instance(budget + 1, budget, 20 * GiB, 14 * GiB, "cuda:0") == 1
    assert check_cap_within_instance(budget + 6 * 10**7, budget, 20 * GiB, 14 * GiB, "cuda:0") == 6 * 10**7
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_within_instance(budget + 6 * 10**7 + 1, budget, 20 * GiB, 14 * GiB, "cuda:0")
    message = str(info.value)
    assert message.startswith("--kv-cache-max-memory 5.65GiB (6060000001 bytes, 5.64 GiB) is larger than what")
    assert "leaves 5.59 GiB (6000000000 bytes) for the KV cache" in message
    with pytest.raises(KVCacheMaxMemoryError):  # 200.99 bytes at most
        check_cap_within_instance(201, 199, 2 * GiB, 2 * GiB, "cuda:0")
    assert check_cap_within_instance(200, 199, 2 * GiB, 2 * GiB, "cuda:0") == 1
    with pytest.raises(KVCacheMaxMemoryError, match="Nothing is left for the KV cache"):
        check_cap_within_instance(1, 0, 2 * GiB, 2 * GiB, "cuda:0")


def test_cap_fits_before_load_tolerates_one_percent_above_the_room_for_kv() -> None:
    """Before loading: 10 GB free and 2 GB of weights leave 8 GB for the KV
    caches; 1% more (80 MB) is accepted, shared by the workers, a byte more
    is refused. An explicit size gets none: vLLM allocates all of it."""
    weights, free = 2 * 10**9, 10**10
    check_cap_fits_before_load(8_080_000_000, weights, 1, free, "cuda:0")
    with pytest.raises(KVCacheMaxMemoryError, match=r"^--kv-cache-max-memory .* \(8080000001 bytes"):
        check_cap_fits_before_load(8_080_000_001, weights, 1, free, "cuda:0")
    check_cap_fits_before_load(4_040_000_000, weights, 2, free, "cuda:0 + cuda:1")
    with pytest.raises(KVCacheMaxMemoryError, match="2 x the cap plus the weights"):
        check_cap_fits_before_load(4_040_000_001, weights, 2, free, "cuda:0 + cuda:1")
    # --kv-cache-memory-bytes under the cap, or reduced to it: no tolerance.
    check_cap_fits_before_load(16 * 10**9, weights, 1, free, "cuda:0", kv_bytes=8 * 10**9, explicit=True)
    with pytest.raises(KVCacheMaxMemoryError, match="set by --kv-cache-memory-bytes"):
        check_cap_fits_before_load(16 * 10**9, weights, 1, free, "cuda:0", kv_bytes=8 * 10**9 + 1, explicit=True)
    with pytest.raises(KVCacheMaxMemoryError):
        check_cap_fits_before_load(8 * 10**9 + 1, weights, 1, free, "cuda:0", kv_bytes=8 * 10**9 + 1, explicit=True)
    # Weights alone above the free memory: nothing to give, no tolerance.
    with pytest.raises(KVCacheMaxMemoryError, match="The weights alone do not fit"):
        check_cap_fits_before_load(1, free + 1, 1, free, "cuda:0")


def test_cap_fits_before_load() -> None:
    check_cap_fits_before_load(4 * GiB, 2 * GiB, 1, 6 * GiB, "cuda:0")
    check_cap_fits_before_load(2 * GiB, 4 * GiB, 2, 8 * GiB, "cuda:0 + cuda:1")
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_fits_before_load(4 * GiB, 2 * GiB, 1, 5 * GiB, "cuda:0")
    message = str(info.value)
    assert "cannot fit on the cuda:0" in message
    assert "weights take at least 2.00 GiB" in message and "5.00 GiB (5368709120 bytes) is free" in message
    assert "Choose at most --kv-cache-max-memory 3GiB" in message
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_fits_before_load(2 * GiB, 4 * GiB, 2, 7 * GiB, "cuda:0 + cuda:1")
    assert "2 x the cap plus the weights" in str(info.value)
    assert "--kv-cache-max-memory 1.5GiB" in str(info.value)
    with pytest.raises(KVCacheMaxMemoryError, match="The weights alone do not fit"):
        check_cap_fits_before_load(1 * GiB, 8 * GiB, 1, 6 * GiB, "cuda:0")
    with pytest.raises(KVCacheMaxMemoryError) as info:  # weights unknown: the cap alone
        check_cap_fits_before_load(8 * GiB, 0, 1, 6 * GiB, "host memory node 0")
    assert "weights take" not in str(info.value)
    # An explicit size under the cap: that size counts, and is named.
    check_cap_fits_before_load(8 * GiB, 1 * GiB, 1, 6 * GiB, "host memory node 0", kv_bytes=4 * GiB)
    with pytest.raises(KVCacheMaxMemoryError) as info:
        check_cap_fits_before_load(8 * GiB, 1 * GiB, 2, 6 * GiB, "host memory node 0", kv_bytes=4 * GiB)
    message = str(info.value)
    assert message.startswith("The KV cache of 4294967296 bytes (4.00 GiB) set by --kv-cache-memory-bytes")
    assert "2 x that size plus the weights" in message and "Choose at most --kv-cache-memory-bytes 2.5GiB" in message


def test_kv_bytes_before_load_is_what_will_be_allocated() -> None:
    assert kv_bytes_before_load(16 * MiB, None, None) == 16 * MiB  # the cap
    assert kv_bytes_before_load(16 * MiB, 8 * MiB, None) == 8 * MiB  # explicit, under the cap
    assert kv_bytes_before_load(16 * MiB, 32 * MiB, None) == 16 * MiB  # explicit, reduced to the cap
    assert kv_bytes_before_load(16 * MiB, None, 64) == 0  # a block count: block size unknown yet


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


# --- the cap error inside an executor's exception (Ray workers) -----------


def test_cap_error_found_in_the_chain_and_as_ray_cause() -> None:
    from vllm_kv_cache_limit.logic.cap_decision import FLAG, cap_error_message
    from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

    cap = KVCacheMaxMemoryError(f"{FLAG} 16MiB is too large")
    try:
        try:
            raise cap
        except KVCacheMaxMemoryError as inner:
            raise RuntimeError("Engine core initialization failed") from inner
    except RuntimeError as outer:
        assert cap_error_message(outer) == str(cap)

    class RayTaskError(KVCacheMaxMemoryError):  # Ray's dual class: its text is a traceback
        def __init__(self, cause: BaseException) -> None:
            super().__init__("ray::RayWorkerWrapper.execute_method() (pid=1) ... traceback ...")
            self.cause = cause

    assert cap_error_message(RayTaskError(cap)) == str(cap)


def test_cap_error_found_in_the_ray_executor_text_only_when_it_names_the_flag() -> None:
    from vllm_kv_cache_limit.logic.cap_decision import FLAG, cap_error_message

    message = f"The KV cache of 16777216 bytes set by {FLAG} 16M does not fit (found by worker rank 1)"
    text = f"Worker failed with error '{message}', please check the stack trace above for the root cause"
    assert cap_error_message(RuntimeError(text)) == message
    other = "Worker failed with error 'CUDA out of memory', please check the stack trace above for the root cause"
    assert cap_error_message(RuntimeError(other)) is None
    assert cap_error_message(ValueError("unrelated")) is None
