"""What each instance's requests saw: TTFT, TPOT and end-to-end latency
percentiles, SLO attainment and goodput, preemptions. Pure arithmetic on
the simulation's records."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    """A request meets it when its TTFT and its TPOT are both at most these (seconds)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile, linear between the closest ranks (numpy's default); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(records: Iterable[Any], seconds: float, slo: SLO) -> dict[str, Any]:
    """One instance's figures over a run of ``seconds`` (its traffic's span)."""
    records = list(records)
    done = [r for r in records if r.finished is not None and r.first_token is not None]
    ttft = [r.first_token - r.arrival for r in done]
    tpot = [(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1]
    e2e = [r.finished - r.arrival for r in done]
    good = [
        r
        for r in done
        if r.first_token - r.arrival <= slo.ttft_s
        and (r.tokens <= 1 or (r.finished - r.first_token) / (r.tokens - 1) <= slo.tpot_s)
    ]
    span = max(seconds, 1e-9)
    result: dict[str, Any] = {
        "requests": len(records),
        "finished": len(done),
        "output_tokens": sum(r.tokens for r in records),
        "throughput_tok_s": sum(r.tokens for r in done) / span,
        "slo_attainment": len(good) / len(records) if records else None,
        "goodput_req_s": len(good) / span,
    }
    for name, values in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e)):
        result[name] = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    return result
