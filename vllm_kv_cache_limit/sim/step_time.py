"""Step-time models: how long the device takes for one scheduled batch.

One small interface (:class:`StepTimeModel`): a batch's composition in, its
seconds out. :class:`LinearStepTime` needs no extra package; the measured
GPU tables come through ``sim.aiconfigurator`` (the ``[sim]`` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class StepTimeError(ValueError):
    """A step-time model's settings that cannot work; the message says what would."""


@dataclass(frozen=True)
class Batch:
    """What one step of one instance runs, as the step-time models read it."""

    decode_requests: int = 0
    """Requests that compute one token of their output (a decode)."""
    prefill_tokens: int = 0
    """Prompt tokens computed in this step, over every request in prefill
    (chunks of long prompts, and the recomputation of preempted requests)."""
    prefill_requests: int = 0
    decode_context_tokens: int = 0
    """The tokens the decoding requests attend to, together (their KV cache)."""

    @property
    def empty(self) -> bool:
        return self.decode_requests == 0 and self.prefill_tokens == 0


class StepTimeModel(Protocol):
    """Seconds the device takes for one step of ``batch`` (0 for an empty one: no model runs)."""

    @property
    def name(self) -> str: ...

    def seconds(self, batch: Batch) -> float: ...


@dataclass(frozen=True)
class LinearStepTime:
    """``t = a + b * decode_requests + c * prefill_tokens`` seconds: a fit of
    measured steps (the CPU backend's step grows about linearly with the batch)."""

    a: float
    b: float
    c: float
    name: str = "linear"

    def __post_init__(self) -> None:
        for key in ("a", "b", "c"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or value != value or value < 0 or value == float("inf"):
                raise StepTimeError(
                    f"the linear step time's {key} is {value!r}; give seconds as a finite number of at least 0 "
                    f"(for example {key}=0.001)."
                )
        if self.a == 0 and self.b == 0 and self.c == 0:
            raise StepTimeError("the linear step time is 0 for every batch (a=b=c=0); give a > 0, for example a=0.005.")

    def seconds(self, batch: Batch) -> float:
        if batch.empty:  # vLLM runs no model for a step that schedules nothing
            return 0.0
        return self.a + self.b * batch.decode_requests + self.c * batch.prefill_tokens

    def describe(self) -> str:
        return f"linear: {self.a:g} s + {self.b:g} s per decode + {self.c:g} s per prefill token"


def parse_linear(text: str) -> LinearStepTime:
    """``a=0.005,b=0.0002,c=0.00003`` (seconds), or the path of a JSON file
    holding ``{"a": ..., "b": ..., "c": ...}``."""
    path = Path(text)
    if "=" not in text:
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise StepTimeError(
                f"--step-time {text!r}: cannot read it as a JSON file ({exc}); give a file holding "
                '{"a": 0.005, "b": 0.0002, "c": 0.00003} or the constants themselves, a=0.005,b=0.0002,c=0.00003.'
            ) from None
        if not isinstance(values, dict) or set(values) - {"a", "b", "c"} or not {"a", "b", "c"} <= set(values):
            raise StepTimeError(
                f"--step-time {text!r}: the file must hold one object with exactly a, b and c (seconds), for "
                'example {"a": 0.005, "b": 0.0002, "c": 0.00003}.'
            )
        return LinearStepTime(**{k: values[k] for k in ("a", "b", "c")})
    values = {}
    for part in text.split(","):
        key, _, raw = part.partition("=")
        key = key.strip()
        if key not in ("a", "b", "c") or key in values:
            raise StepTimeError(
                f"--step-time {text!r}: {part!r} is not one of a=, b=, c= (each once); for example "
                "a=0.005,b=0.0002,c=0.00003."
            )
        try:
            values[key] = float(raw)
        except ValueError:
            raise StepTimeError(
                f"--step-time {text!r}: {raw!r} is not a number of seconds; for example {key}=0.0002."
            ) from None
    return LinearStepTime(a=values.get("a", 0.0), b=values.get("b", 0.0), c=values.get("c", 0.0))
