"""Traffic for the simulation: the Azure LLM inference traces 2023 (a copy
ships in ``traces/``; read by path, their checksum checked), and Poisson
and gamma (bursty) arrivals.

Each arrival is a time in seconds from the start of the run, a prompt
length and an output length. Traces are sliced (a start minute and a
number of minutes), their time scaled (``time_scale`` 2: twice as fast),
and their token counts scaled and capped, so that a trace fits a model's
``max_model_len``.
"""

from __future__ import annotations

import csv
import hashlib
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

AZURE_FILES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
"""The two traces by short name: the conversation service and the coding service."""
AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
CHECKSUMS = "SHA256SUMS"
TRACES = Path(__file__).with_name("traces")
"""The copy of the two traces in the package (``traces/README.md``: source, attribution, license),
replayed where no other folder is given."""


class TrafficError(ValueError):
    """Traffic settings or a trace file that cannot be used; the message says what would."""


@dataclass(frozen=True)
class Arrival:
    at: float
    """Seconds from the start of the run."""
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Tokens:
    """How a trace's token counts map onto a simulated model."""

    prompt_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt: int | None = None
    max_output: int | None = None
    max_total: int | None = None
    """Prompt and output together at most this (``max_model_len``): the output is cut first."""

    def apply(self, prompt: int, output: int) -> tuple[int, int]:
        prompt = max(1, round(prompt * self.prompt_scale))
        output = max(1, round(output * self.output_scale))
        if self.max_prompt is not None:
            prompt = min(prompt, self.max_prompt)
        if self.max_output is not None:
            output = min(output, self.max_output)
        if self.max_total is not None:
            prompt = min(prompt, self.max_total - 1)
            output = max(1, min(output, self.max_total - prompt))
        return prompt, output


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checked(path: Path) -> None:
    """Refuse a trace whose SHA-256 differs from the one its folder's ``SHA256SUMS`` gives for it."""
    sums = path.parent / CHECKSUMS
    try:
        lines = sums.read_text().splitlines()
    except OSError as exc:
        raise TrafficError(
            f"the trace {path} has no checksum to check it against ({sums}: {exc.strerror}); keep the SHA256SUMS "
            "that comes with the Azure traces beside it."
        ) from None
    wanted = {name.strip().lstrip("*"): digest for digest, _, name in (line.partition(" ") for line in lines if line)}
    if path.name not in wanted:
        raise TrafficError(f"{sums} gives no checksum for {path.name}; it lists {', '.join(sorted(wanted)) or 'none'}.")
    found = _sha256(path)
    if found != wanted[path.name].lower():
        raise TrafficError(
            f"the trace {path} is not the published one: its SHA-256 is {found}, {sums} says "
            f"{wanted[path.name]}. Fetch it again from Azure/AzurePublicDataset."
        )


def trace_path(folder: str | None, name: str) -> Path:
    """The file of trace ``name`` (``conv``, ``code``) in ``folder`` (None: the
    package's copy, :data:`TRACES`), or a CSV file's own path."""
    if name in AZURE_FILES:
        return Path(folder or TRACES) / AZURE_FILES[name]
    path = Path(name)
    if path.suffix == ".csv":
        return path
    raise TrafficError(f"trace {name!r}: give conv, code, or the path of one of the Azure traces' CSV files.")


def load_azure(
    path: Path, start_min: float = 0.0, minutes: float | None = None, time_scale: float = 1.0, tokens: Tokens = Tokens()
) -> list[Arrival]:
    """The requests of one Azure trace that arrive from ``start_min`` for
    ``minutes`` of the trace (all after it: None), their times from the
    slice's start divided by ``time_scale``."""
    if time_scale <= 0 or start_min < 0 or (minutes is not None and minutes <= 0):
        raise TrafficError(
            f"trace slice start {start_min} min, {minutes} min, time scale {time_scale}: give a start of at least "
            "0, a positive length and a positive time scale (for example --start-min 0 --minutes 1 --time-scale 1)."
        )
    checked(path)
    with path.open(newline="") as file:
        rows = csv.reader(file)
        header = next(rows, None)
        if header != AZURE_HEADER:
            raise TrafficError(f"{path}: the header is {header}, not {AZURE_HEADER}; is it one of the Azure traces?")
        arrivals, first = [], None
        for number, row in enumerate(rows, start=2):
            try:
                when = datetime.fromisoformat(row[0][:26]).timestamp()
                prompt, output = int(row[1]), int(row[2])
            except (IndexError, ValueError):
                raise TrafficError(
                    f"{path}, line {number}: {row} is not a time, a prompt and an output length."
                ) from None
            first = when if first is None else first
            offset = when - first - start_min * 60
            if offset < 0 or (minutes is not None and offset >= minutes * 60):
                continue
            arrivals.append(Arrival(offset / time_scale, *tokens.apply(prompt, output)))
    return arrivals


def poisson(
    rate: float, seconds: float, prompt: int, output: int, seed: int = 0, tokens: Tokens = Tokens()
) -> list[Arrival]:
    """Arrivals at ``rate`` a second on average for ``seconds``, exponential gaps."""
    return gamma(rate, 1.0, seconds, prompt, output, seed, tokens)


def gamma(
    rate: float, cv: float, seconds: float, prompt: int, output: int, seed: int = 0, tokens: Tokens = Tokens()
) -> list[Arrival]:
    """Arrivals at ``rate`` a second on average whose gaps have coefficient of
    variation ``cv`` (gamma gaps: 1 is Poisson, above 1 bursty)."""
    if rate <= 0 or cv <= 0 or seconds <= 0 or prompt < 1 or output < 1:
        raise TrafficError(
            f"arrivals at {rate}/s, cv {cv}, for {seconds} s of {prompt}+{output} tokens: give positive numbers "
            "(for example --rate 2 --cv 1 --seconds 30, 256 prompt and 64 output tokens)."
        )
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    arrivals: list[Arrival] = []
    now = 0.0
    while True:
        now += rng.gammavariate(shape, scale)
        if now >= seconds:
            return arrivals
        arrivals.append(Arrival(now, *tokens.apply(prompt, output)))
