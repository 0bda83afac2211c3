"""The size parser and formatter, and the count parser: tables of valid and
invalid inputs."""

from __future__ import annotations

import re

import pytest

from vllm_kv_cache_limit import format_size, parse_size
from vllm_kv_cache_limit.logic.sizes import parse_count

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8589934592", 8 * GiB),
        (8589934592, 8 * GiB),
        ("512B", 512),
        ("1", 1),
        ("8K", 8 * 2**10),
        ("8M", 8 * 2**20),
        ("8G", 8 * GiB),
        ("2T", 2 * 2**40),
        ("8k", 8_000),
        ("8m", 8_000_000),
        ("8g", 8_000_000_000),
        ("2t", 2_000_000_000_000),
        ("512MiB", 512 * 2**20),
        ("512miB", 512 * 2**20),
        ("512MIB", 512 * 2**20),
        ("4KiB", 4096),
        ("1TiB", 2**40),
        ("8Gi", 8 * GiB),
        ("8gi", 8 * GiB),
        ("16Mi", 16 * 2**20),
        ("2Ki", 2048),
        ("1Ti", 2**40),
        ("16GB", 16 * 10**9),
        ("16gB", 16 * 10**9),
        ("5KB", 5000),
        ("3MB", 3 * 10**6),
        ("1TB", 10**12),
        ("1.5G", int(1.5 * GiB)),
        ("1.5GiB", int(1.5 * GiB)),
        ("0.5M", 2**19),
        (".5K", 512),
        ("1.0000000001K", 1024),  # rounded down to a whole byte
        ("2.9999B", 2),
        (" 8 GiB ", 8 * GiB),
        ("\t8G", 8 * GiB),
        ("8 G", 8 * GiB),
        ("9223372036854775808", 2**63),
        ("8388608TiB", 2**63),
    ],
)
def test_valid_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "0",
        "0G",
        "0.0001B",
        0,
        -1,
        "-1G",
        "nan",
        "inf",
        "NaN",
        "1e9",
        "1E3K",
        "8X",
        "8GG",
        "8 gigs",
        "8GiBs",
        "G",
        "1.",
        "1.5.5G",
        "8b",  # bits are not bytes
        "8Gb",  # gigabits
        "16gb",
        "512mib",  # mebibits
        "8KIb",
        "8 8G",
        "1,5G",
        "٨G",  # Arabic-Indic digit eight
        "８G",  # full-width digit eight
        "9223372036854775809",
        2**63 + 1,
        "8388609TiB",
        "99999999999999999999999999T",
    ],
)
def test_invalid_sizes_quote_input(text: str | int) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert repr(text) in message
    assert "'8G'" in message and "'512MiB'" in message


@pytest.mark.parametrize("value", [True, False, 1.5, 8.0, None, b"8G", [8]])
def test_wrong_types_are_refused(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(value)  # type: ignore[arg-type]
    assert repr(value) in str(info.value)


def test_float_suggests_a_string() -> None:
    with pytest.raises(ValueError, match=r"pass a string such as '1.5G'"):
        parse_size(1.5)


@pytest.mark.parametrize(
    ("nbytes", "rounding", "expected"),
    [
        (8 * GiB, "down", "8GiB"),
        (int(2.25 * GiB), "up", "2.25GiB"),
        (int(2.25 * GiB) + 1, "up", "2.26GiB"),
        (int(2.25 * GiB) + 1, "down", "2.25GiB"),
        (16 * 2**20, "up", "16MiB"),
        (1000, "up", "1000B"),
        (1024, "down", "1KiB"),
        (0, "down", "0B"),
    ],
)
def test_format_size(nbytes: int, rounding: str, expected: str) -> None:
    assert format_size(nbytes, rounding) == expected


@pytest.mark.parametrize("nbytes", [1, 1023, 1024, 1536, 10**9, 7 * GiB + 12345, 2**40 + 3])
def test_format_size_round_trips_in_the_right_direction(nbytes: int) -> None:
    assert parse_size(format_size(nbytes, "up")) >= nbytes
    if nbytes >= 1:
        assert parse_size(format_size(nbytes, "down")) <= nbytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", 512),
        (" 4096 ", 4096),
        ("32k", 32_000),
        ("32K", 32 * 2**10),
        ("1.5k", 1_500),
        ("2m", 2_000_000),
        ("2M", 2 * 2**20),
        ("1g", 10**9),
        ("1G", 2**30),
        ("8 k", 8_000),
        ("0", 0),
    ],
)
def test_valid_counts_read_like_vllm(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "long", "-5", "1.5", "1.5K", "8T", "8kb", "1e3", "0x10", "k"])
def test_invalid_counts_quote_input(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Invalid count {text!r}")):
        parse_count(text)


@pytest.mark.parametrize(
    ("text", "bytes_spelling"), [("8Gb", "8GB"), ("16 gb", "16gB"), ("512mib", "512miB"), ("1b", "1B")]
)
def test_a_lower_case_b_is_bits_and_the_error_names_the_bytes_spelling(text: str, bytes_spelling: str) -> None:
    """vLLM's own size flags take no ``b`` at all; a lower-case ``b`` is the
    symbol of bits, so ``8Gb`` is refused rather than read as 8 GB, and the
    error suggests the spelling in bytes, which is accepted."""
    with pytest.raises(ValueError) as info:
        parse_size(text)
    message = str(info.value)
    assert "bits" in message and f"'{bytes_spelling}'" in message, message
    assert parse_size(bytes_spelling) > 0
