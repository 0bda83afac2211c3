"""The planner's arithmetic: blocks, capacity and the tidy cap, without vLLM."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kv_cache_limit.logic.sizes import format_size, parse_size
from vllm_kv_cache_limit.plan import (
    NULL_BLOCKS,
    PlanError,
    bytes_per_token,
    capacity,
    least_bytes_for,
    required_blocks,
    suggest_cap,
)


def test_arithmetic_imports_neither_vllm_nor_torch() -> None:
    """The arithmetic stays pure: importing it in a fresh interpreter loads
    no vLLM and no torch."""
    code = (
        "import sys, vllm_kv_cache_limit.plan.arithmetic\n"
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_required_blocks_adds_the_null_block() -> None:
    assert NULL_BLOCKS == 1
    assert required_blocks(4, 1) == 5
    assert required_blocks(4, 3) == 13
    assert required_blocks(9, 2) == 19


@pytest.mark.parametrize("per_request, concurrency", [(0, 1), (4, 0), (-1, 2)])
def test_required_blocks_rejects_impossible_numbers(per_request: int, concurrency: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        required_blocks(per_request, concurrency)


def test_capacity_leaves_out_the_null_block() -> None:
    # 16 MiB of 128 KiB blocks: 128 blocks, 127 usable, 4 blocks per 512 tokens.
    assert capacity(128, 4, 512) == (127, 127 * 128, 31)
    assert capacity(5, 4, 512) == (4, 512, 1)
    assert capacity(1, 4, 512) == (0, 0, 0)
    assert capacity(0, 4, 512) == (0, 0, 0)
    # Gemma 2 style: 12 blocks per 1024-token request across two groups.
    assert capacity(25, 12, 1024) == (24, 2048, 2)


def test_bytes_per_token_is_an_int_when_the_block_divides() -> None:
    assert bytes_per_token(131072, 128) == 1024
    assert isinstance(bytes_per_token(131072, 128), int)
    assert bytes_per_token(1000, 128) == pytest.approx(7.8125)


def _unit_step(text: str) -> Decimal:
    """One step of the last decimal of a format_size result, in bytes."""
    number = text.rstrip("KMGTiB")
    unit = text[len(number) :]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return Decimal(parse_size(f"1{unit}")) / 10 ** max(decimals, 2) if unit != "B" else Decimal(1)


@given(
    block_bytes=st.integers(min_value=1, max_value=2**24),
    per_request=st.integers(min_value=1, max_value=4096),
    concurrency=st.integers(min_value=1, max_value=512),
)
def test_suggested_cap_is_the_smallest_tidy_size_that_fits(
    block_bytes: int, per_request: int, concurrency: int
) -> None:
    needed = required_blocks(per_request, concurrency)
    text, nbytes, blocks = suggest_cap(needed * block_bytes, needed, lambda n: n // block_bytes)
    assert text == format_size(needed * block_bytes, "up")
    assert nbytes == parse_size(text)
    assert blocks == nbytes // block_bytes >= needed
    # One step less in the same unit no longer holds the blocks.
    smaller = Decimal(nbytes) - _unit_step(text)
    assert int(smaller) // block_bytes < needed


def test_suggested_cap_steps_up_when_the_engine_rounds_differently() -> None:
    # An allocator that keeps 100 KiB aside: 640KiB gives 4 blocks, not 5.
    block = 128 * 1024

    def blocks_for(nbytes: int) -> int:
        return max(0, nbytes - 100 * 1024) // block

    text, nbytes, blocks = suggest_cap(5 * block, 5, blocks_for)
    assert (text, blocks) == ("740KiB", 5)
    assert blocks_for(nbytes - int(_unit_step(text)) - 1) == 4


def test_suggested_cap_when_the_engine_gives_more_than_the_arithmetic() -> None:
    # Blocks counted from 10 bytes below the arithmetic's: the least size is smaller.
    text, nbytes, blocks = suggest_cap(5 * 1024, 5, lambda n: (n + 10) // 1024)
    assert least_bytes_for(5, 5 * 1024, lambda n: (n + 10) // 1024) == 5 * 1024 - 10
    assert (text, blocks) == (format_size(5 * 1024 - 10, "up"), 5)


def test_suggested_cap_gives_up_with_a_plan_error() -> None:
    with pytest.raises(PlanError, match="gives 5 KV cache blocks"):
        suggest_cap(5 * 1024, 5, lambda nbytes: 0)
