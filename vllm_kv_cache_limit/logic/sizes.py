"""Memory sizes with units: one parser for the CLI, the Python API and the
environment variable, and a formatter that writes sizes back in tidy units;
and counts (token counts, block sizes) written the way vLLM's CLI reads them.

Pure logic: no vLLM import, so it is cheap to import and easy to test.
"""

from __future__ import annotations

import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

__all__ = ["MAX_SIZE_BYTES", "parse_count", "parse_size", "format_size", "format_gib", "suggest_size"]

MAX_SIZE_BYTES = 2**63
"""Largest size accepted, in bytes (sizes are carried as signed 64-bit)."""

VALID_EXAMPLES = "'8G', '512MiB', '1.5GiB', '16 GB' or '8589934592' (bytes)"

# One-letter suffixes follow vLLM's own convention for size arguments
# (``--kv-cache-memory-bytes``, ``--max-model-len``): upper case is binary,
# lower case is decimal.
_ONE_LETTER = {
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}
# Explicit units: the prefix in any letter case, the B upper case (a
# lower-case b is the symbol of bits; vLLM's own size flags take no b at all).
_EXPLICIT = {
    "": 1,
    "b": 1,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_UNITS_HELP = (
    "units: K M G T (binary, as in vLLM), k m g t (decimal), "
    "KiB MiB GiB TiB (binary), KB MB GB TB (decimal), B or none (bytes); a lower-case b (bits) is refused"
)
# ASCII digits only: str.isdigit() and \d accept other scripts' digits too.
_SIZE_RE = re.compile(r"^[ \t]*(?P<number>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)[ \t]*(?P<unit>[A-Za-z]*)[ \t]*$")


def _invalid(value: object, reason: str) -> ValueError:
    return ValueError(
        f"Invalid size {value!r}: {reason}. Expected a positive number with an "
        f"optional unit, for example {VALID_EXAMPLES}; {_UNITS_HELP}."
    )


def _multiplier(unit: str) -> int | None:
    if len(unit) == 1 and unit in _ONE_LETTER:
        return _ONE_LETTER[unit]
    if unit.endswith("b"):
        # Lower-case 'b' is the usual symbol for bits; refuse it.
        return None
    return _EXPLICIT.get(unit.lower())


def parse_size(value: str | int) -> int:
    """Return the number of bytes that ``value`` denotes.

    ``value`` is an int of bytes or a string such as ``"8G"``, ``"512MiB"``,
    ``"1.5GiB"`` or ``" 16 GB "``. Fractional sizes are rounded down to a whole
    byte. Raises ``ValueError`` quoting the input for anything else.
    """
    if isinstance(value, bool):
        raise _invalid(value, "a bool is not a size")
    if isinstance(value, float):
        raise _invalid(
            value, f"a float is ambiguous; pass a string such as '{value!r}G' or '{value!r}GiB', or an int of bytes"
        )
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise _invalid(value, "not a number followed by a unit")
        multiplier = _multiplier(match["unit"])
        if multiplier is None:
            unit = match["unit"]
            in_bytes = unit[:-1] + "B"
            if unit.endswith("b") and _multiplier(in_bytes) is not None:
                raise _invalid(
                    value, f"a lower-case b means bits, not bytes: for bytes write {match['number'] + in_bytes!r}"
                )
            raise _invalid(value, f"unknown unit {unit!r}")
        try:
            exact = Decimal(match["number"]) * multiplier
        except InvalidOperation:  # pragma: no cover - the regex admits none
            raise _invalid(value, "not a number") from None
        if exact > MAX_SIZE_BYTES:
            raise _invalid(value, "larger than 2**63 bytes")
        nbytes = int(exact.to_integral_value(rounding=ROUND_FLOOR))
    else:
        raise _invalid(value, f"expected a str or an int, got {type(value).__name__}")

    if nbytes <= 0:
        raise _invalid(value, "the size must be at least one byte")
    if nbytes > MAX_SIZE_BYTES:
        raise _invalid(value, "larger than 2**63 bytes")
    return nbytes


_COUNT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*$")
_COUNT_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_count(value: str) -> int:
    """Return the whole number ``value`` denotes, read as vLLM's CLI reads
    counts such as ``--max-model-len``: ``"512"``, ``"32k"`` (32000, lower
    case is decimal), ``"32K"`` (32768, upper case is binary), ``"1.5k"``
    (1500). Decimals go with lower-case suffixes only, as in vLLM, and are
    rounded down. Raises ``ValueError`` quoting the input for anything else.
    """
    match = _COUNT_RE.match(value)
    if match is None:
        raise ValueError(f"Invalid count {value!r}: expected a whole number with an optional k, m, g, K, M or G")
    number, suffix = match.groups()
    scale = _COUNT_SCALE[suffix]
    if "." in number:
        if suffix == "" or suffix.isupper():
            raise ValueError(f"Invalid count {value!r}: decimals need a lower-case (decimal) suffix such as k")
        return int(float(number) * scale)
    return int(number) * scale


_BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_size(nbytes: int, rounding: str = "down") -> str:
    """Write ``nbytes`` in the largest binary unit it reaches, with at most two
    decimals, e.g. ``"2.25GiB"``.

    ``rounding="down"`` gives the largest such value not above ``nbytes`` (a
    size that still fits); ``"up"`` the smallest not below it (a size that
    still holds ``nbytes``). ``parse_size`` reads the result back.
    """
    if rounding not in ("down", "up"):
        raise ValueError(f"rounding must be 'down' or 'up', got {rounding!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    for unit, size in _BINARY_UNITS:
        if nbytes >= size:
            count = nbytes * 100 // size if rounding == "down" else -(-nbytes * 100 // size)
            whole, frac = divmod(count, 100)
            text = f"{whole}.{frac:02d}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return f"{nbytes}B"


def suggest_size(least: int, most: int | None = None, prefer: str = "least") -> str:
    """A size to suggest in an error, within ``[least, most]``: tidy
    (``format_size``) where such a one reads back (``parse_size``) within
    the bounds, else the exact bytes. ``prefer="least"`` suggests the
    smallest such size, ``"most"`` the largest. A suggestion must be a value
    the same call accepts: "at least 1.12MiB" for 1179648 bytes would not be
    (1.12MiB is 1174405 bytes)."""
    if most is None:
        most = MAX_SIZE_BYTES
    if not 1 <= least <= most:
        raise ValueError(f"no size lies within [{least}, {most}]")
    tidy = format_size(least, "up") if prefer == "least" else format_size(most, "down")
    if least <= parse_size(tidy) <= most:
        return tidy
    return str(least if prefer == "least" else most)


def format_gib(nbytes: int) -> str:
    """Bytes as GiB with two decimals, as vLLM writes memory in its logs."""
    return f"{nbytes / 2**30:.2f}"


def argparse_size(value: str) -> int:
    """``parse_size`` as an argparse ``type``: argparse prints an
    ``ArgumentTypeError``'s message (a ``ValueError``'s it would hide)."""
    import argparse

    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
