"""Property-based tests for the size parser: every valid spelling parses to
the exact byte count, and any other input raises ``ValueError`` quoting it.

The expected byte counts are computed here independently of the parser,
with ``fractions.Fraction`` and the unit definitions written out below.
"""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import example, given
from hypothesis import strategies as st

from vllm_kv_cache_limit.logic.sizes import MAX_SIZE_BYTES, format_size, parse_size

PREFIXES = "KMGT"  # powers 1..4 of 1024 (binary) or 1000 (decimal)

# ---------------------------------------------------------------------------
# The oracle: which unit spellings exist and what they multiply by.
# ---------------------------------------------------------------------------


def unit_multiplier(unit: str) -> int | None:
    """Bytes per unit for ``unit``, or None when it is not a valid unit.

    K M G T are binary and k m g t decimal (vLLM's convention for one-letter
    suffixes); Ki/KiB.. are binary and KB.. decimal in any letter case; B or
    nothing is bytes; a lower-case b (bits) is refused."""
    if unit.endswith("b"):
        return None
    if unit in ("", "B"):
        return 1
    if len(unit) == 1 and unit.upper() in PREFIXES:
        power = PREFIXES.index(unit.upper()) + 1
        return 1024**power if unit.isupper() else 1000**power
    lowered = unit.lower()
    if len(lowered) in (2, 3) and lowered[0].upper() in PREFIXES:
        power = PREFIXES.index(lowered[0].upper()) + 1
        if lowered[1:] in ("i", "ib"):
            return 1024**power
        if lowered[1:] == "b":
            return 1000**power
    return None


def expected_bytes(number: str, unit: str) -> int | None:
    """Whole bytes for ``number`` ``unit`` (rounded down), or None when the
    result is out of range (below one byte, above 2**63)."""
    multiplier = unit_multiplier(unit)
    assert multiplier is not None
    exact = Fraction(number) * multiplier
    if exact > MAX_SIZE_BYTES:
        return None
    nbytes = math.floor(exact)
    return nbytes if nbytes >= 1 else None


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

digits = st.text(alphabet="0123456789", min_size=1, max_size=22)
numbers = st.one_of(
    digits,
    st.builds(lambda whole, frac: f"{whole}.{frac}", digits, digits),
    st.builds(lambda frac: f".{frac}", digits),
    # Small numbers are the interesting ones next to large units.
    st.integers(min_value=0, max_value=4096).map(str),
    st.builds(
        lambda whole, frac: f"{whole}.{frac}",
        st.integers(min_value=0, max_value=99),
        st.integers(min_value=0, max_value=999),
    ),
)
spaces = st.text(alphabet=" \t", max_size=3)


@st.composite
def any_case(draw: st.DrawFn, word: str) -> str:
    """``word`` with each letter in an independently drawn case."""
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    return "".join(c.upper() if up else c.lower() for c, up in zip(word, flips))


@st.composite
def unit_spellings(draw: st.DrawFn) -> str:
    """Every spelling of every valid unit."""
    prefix = draw(st.sampled_from(PREFIXES))
    return draw(
        st.one_of(
            st.sampled_from(["", "B"]),
            st.just(prefix),  # binary
            st.just(prefix.lower()),  # decimal
            any_case(prefix + "i"),  # binary
            any_case(prefix + "i").map(lambda u: u + "B"),  # binary
            any_case(prefix).map(lambda u: u + "B"),  # decimal
        )
    )


@st.composite
def valid_sizes(draw: st.DrawFn) -> tuple[str, str, str]:
    """(text, number, unit) with spaces around and between the parts."""
    number = draw(numbers)
    unit = draw(unit_spellings())
    text = draw(spaces) + number + draw(spaces) + unit + draw(spaces)
    return text, number, unit


def assert_quoting_value_error(value: object) -> ValueError:
    """``parse_size(value)`` raises ValueError (no other exception) whose
    message quotes the input."""
    try:
        result = parse_size(value)  # type: ignore[arg-type]
    except ValueError as exc:
        assert repr(value) in str(exc), f"{exc} does not quote {value!r}"
        return exc
    raise AssertionError(f"parse_size({value!r}) returned {result!r}, expected ValueError")


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@given(valid_sizes())
@example((" 8 GiB ", "8", "GiB"))
@example(("\t1.5\tg\t", "1.5", "g"))
@example(("8388608TiB", "8388608", "TiB"))  # exactly 2**63
@example(("8388608.000001TiB", "8388608.000001", "TiB"))  # just above
@example(("0.0001K", "0.0001", "K"))  # below one byte
def test_valid_spellings_parse_to_exact_bytes(case: tuple[str, str, str]) -> None:
    text, number, unit = case
    expected = expected_bytes(number, unit)
    if expected is None:
        exc = assert_quoting_value_error(text)
        assert "at least one byte" in str(exc) or "2**63" in str(exc)
    else:
        assert parse_size(text) == expected


@given(st.from_regex(r"\A[0-9]{1,4}(\.[0-9]{1,3})?\Z"), st.text(alphabet="kmgtibKMGTIBxXs", max_size=4))
@example("1", "b")  # bits, not bytes
@example("8", "Gb")  # gigabits
@example("1", "kbit")
@example("1", "KiBB")
def test_unit_letters_parse_exactly_when_they_spell_a_unit(number: str, unit: str) -> None:
    """Random letter strings after a number: accepted exactly when the oracle
    knows them as a unit, refused with the unit named otherwise (a unit in
    bits with the spelling in bytes)."""
    text = number + unit
    if unit_multiplier(unit) is None:
        exc = assert_quoting_value_error(text)
        in_bytes = unit[:-1] + "B"
        if unit.endswith("b") and unit_multiplier(in_bytes) is not None:
            # Bits: the error names the spelling in bytes, which is accepted.
            assert f"for bytes write {number + in_bytes!r}" in str(exc)
            if (in_bytes_expected := expected_bytes(number, in_bytes)) is not None:
                assert parse_size(number + in_bytes) == in_bytes_expected
        else:
            assert f"unknown unit {unit!r}" in str(exc)
    elif (expected := expected_bytes(number, unit)) is None:
        assert_quoting_value_error(text)
    else:
        assert parse_size(text) == expected


@given(st.text())
@example("")
@example("\n8G")  # only spaces and tabs are allowed around the size
@example("８G")  # full-width digit
@example("٣G")  # Arabic-Indic digit
@example("1e9")
@example("0x10")
@example("1_000")
@example("-1G")
@example("inf")
@example("NaN")
@example("9" * 5000)
def test_any_text_parses_or_raises_value_error_quoting_it(text: str) -> None:
    try:
        result = parse_size(text)
    except ValueError as exc:
        assert repr(text) in str(exc), f"{exc} does not quote {text!r}"
        assert "for example" in str(exc), "the message must say what would work"
        return
    assert isinstance(result, int) and 1 <= result <= MAX_SIZE_BYTES


@given(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.binary(max_size=8),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
        st.complex_numbers(),
        st.fractions(),
        st.decimals(allow_nan=False),
        st.integers(max_value=0),
        st.integers(min_value=MAX_SIZE_BYTES + 1),
    )
)
def test_non_sizes_raise_value_error_quoting_them(value: object) -> None:
    assert_quoting_value_error(value)


@given(st.integers(min_value=1, max_value=MAX_SIZE_BYTES))
def test_int_bytes_parse_to_themselves(nbytes: int) -> None:
    assert parse_size(nbytes) == nbytes


@given(st.integers(min_value=1, max_value=MAX_SIZE_BYTES))
@example(2**63 - 1)
@example(1023)
@example(1024)
def test_format_size_reads_back_in_the_requested_direction(nbytes: int) -> None:
    """``format_size(n, "down")`` never exceeds n and ``"up"`` never falls
    short of it; both stay within 1% (two decimals of a unit >= 1)."""
    down = parse_size(format_size(nbytes, "down"))
    up = parse_size(format_size(nbytes, "up"))
    assert down <= nbytes <= up
    assert nbytes - down <= nbytes / 100 + 1
    assert up - nbytes <= nbytes / 100 + 1
