"""``vllm-kv-sim calibrate``: the linear step-time model fitted to this
machine's measured engine steps, so that the simulator can be checked
against a real engine on the same machine.

A real vLLM engine (``vllm.LLM``, its engine core in this process) is
driven through a designed set of batches: decode-only with 1 to
``max_num_seqs`` requests (short and long contexts), prefill-only with
several prompt lengths and counts, and prefills added to running decodes.
Each step of vLLM's engine core is timed (``EngineCore.step_fn``, wrapped
on the instance: scheduling, the model and the update of the requests, the
work the simulator charges to the step) and its batch read from the
``SchedulerOutput``. A least-squares fit of ``t = a + b * decoding + c *
prompt tokens`` (relative residuals, coefficients of at least 0) on the
fastest of each batch composition's repeats (``--quantile 0``, as
``timeit`` takes the fastest: a step is never faster than the engine's own
work, and one slowed by another process on a shared machine is that
process's time, not the engine's) is written as the JSON
``--step-time FILE`` reads; its R^2 and relative errors are printed.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kv_cache_limit.sim.step_time import Batch, LinearStepTime, StepTimeError

COLUMNS = ["decode_requests", "prefill_tokens", "seconds"]
"""The header of a measurements CSV file (``--measurements``, ``--from-measurements``)."""
TERMS = ("a", "b", "c")
QUANTILE = 0.0
"""The quantile of each batch composition's times that is fitted (0: the fastest)."""
VOCAB = 500
"""Token ids drawn for the prompts (the tiny Llama's vocabulary is 503)."""


class CalibrationError(ValueError):
    """Measurements or settings that cannot give a fit; the message says what would."""


@dataclass(frozen=True)
class Measurement:
    """One timed engine step: its batch and its seconds."""

    decode_requests: int
    prefill_tokens: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    """The fitted model and how well it explains the measurements it was fitted on."""

    model: LinearStepTime
    r2: float
    """Of the compositions' times (1: every one on the fitted plane)."""
    max_rel_error: float
    mean_rel_error: float
    compositions: int
    steps: int


def validated(measurements: Iterable[Measurement]) -> list[Measurement]:
    """The measurements, refused with a message that quotes the first bad one."""
    found = list(measurements)
    for m in found:
        counts_ok = all(isinstance(v, int) and v >= 0 for v in (m.decode_requests, m.prefill_tokens))
        if not counts_ok or not isinstance(m.seconds, (int, float)) or not math.isfinite(m.seconds) or m.seconds <= 0:
            raise CalibrationError(
                f"measurement {m}: give whole numbers of at least 0 for decode_requests and prefill_tokens and a "
                "finite time of more than 0 seconds, e.g. Measurement(decode_requests=8, prefill_tokens=0, "
                "seconds=0.004)."
            )
        if m.decode_requests == 0 and m.prefill_tokens == 0:
            raise CalibrationError(f"measurement {m} schedules nothing; an empty step runs no model and takes no time.")
    return found


def per_composition(measurements: Sequence[Measurement], quantile: float = QUANTILE) -> list[Measurement]:
    """One point per batch composition: that quantile of its times (a step
    now and then slowed by a neighbour on a shared machine moves it little)."""
    from vllm_kv_cache_limit.sim.metrics import percentile

    groups: dict[tuple[int, int], list[float]] = {}
    for m in measurements:
        groups.setdefault((m.decode_requests, m.prefill_tokens), []).append(m.seconds)
    return [Measurement(d, p, percentile(t, 100 * quantile) or 0.0) for (d, p), t in sorted(groups.items())]


def _least_squares(points: Sequence[Measurement], terms: tuple[str, ...]) -> dict[str, float] | None:
    """Relative least squares on ``terms`` only (the others 0); None where a coefficient comes out below 0."""
    import numpy as np

    columns = {
        "a": [1.0] * len(points),
        "b": [p.decode_requests for p in points],
        "c": [p.prefill_tokens for p in points],
    }
    weights = np.array([1.0 / p.seconds for p in points])
    matrix = np.array([columns[t] for t in terms]).T * weights[:, None]
    solution, *_ = np.linalg.lstsq(matrix, np.ones(len(points)), rcond=None)
    if any(v < 0 for v in solution):
        return None
    return {t: (float(solution[terms.index(t)]) if t in terms else 0.0) for t in TERMS}


def fit(measurements: Iterable[Measurement], quantile: float = QUANTILE) -> Fit:
    """``t = a + b * decode_requests + c * prefill_tokens`` through the
    compositions' times (:func:`per_composition`), minimising the relative residuals, with
    ``a, b, c >= 0`` (the best of the least-squares fits on each subset of
    the terms whose coefficients are all at least 0: the non-negative
    optimum for three terms)."""
    steps = validated(measurements)
    if not 0 <= quantile <= 1:
        raise CalibrationError(f"--quantile {quantile!r}: give a fraction from 0 to 1, e.g. 0.25 or 0.5 (the median).")
    points = per_composition(steps, quantile)
    if not any(p.decode_requests for p in points) or not any(p.prefill_tokens for p in points):
        raise CalibrationError(
            f"the measurements hold {len(points)} batch composition(s), "
            f"{'none with a decoding request' if not any(p.decode_requests for p in points) else 'none with prompt tokens'}"
            "; the fit needs decode steps and prefill steps (calibrate's design measures both)."
        )
    if len(points) < len(TERMS) + 1:
        raise CalibrationError(
            f"the measurements hold {len(points)} batch compositions; the fit of a, b and c needs at least "
            f"{len(TERMS) + 1} different ones (for example 1, 8 and 32 decoding requests and a prefill of 256 tokens)."
        )
    best: tuple[float, LinearStepTime] | None = None
    for size in range(len(TERMS), 0, -1):
        for terms in itertools.combinations(TERMS, size):
            found = _least_squares(points, terms)
            if found is None or not any(found.values()):
                continue
            candidate = LinearStepTime(found["a"], found["b"], found["c"])
            residual = sum(e * e for e in relative_errors(candidate, points))
            if best is None or residual < best[0] - 1e-15:
                best = (residual, candidate)
    if best is None:
        raise CalibrationError("no fit with a, b, c >= 0 explains these measurements; are the times in seconds?")
    model = best[1]
    errors = [abs(e) for e in relative_errors(model, points)]
    return Fit(model, r_squared(model, points), max(errors), statistics.fmean(errors), len(points), len(steps))


def relative_errors(model: LinearStepTime, points: Iterable[Measurement]) -> list[float]:
    """(predicted - measured) / measured per point."""
    return [(model.seconds(Batch(p.decode_requests, p.prefill_tokens)) - p.seconds) / p.seconds for p in points]


def r_squared(model: LinearStepTime, points: Sequence[Measurement]) -> float:
    """1 - residual / total sum of squares of the times (nan for points all of one time)."""
    mean = statistics.fmean(p.seconds for p in points)
    total = sum((p.seconds - mean) ** 2 for p in points)
    residual = sum((model.seconds(Batch(p.decode_requests, p.prefill_tokens)) - p.seconds) ** 2 for p in points)
    return 1.0 - residual / total if total > 0 else math.nan


def write_model(model: LinearStepTime, path: Path) -> None:
    """The JSON ``--step-time FILE`` reads: exactly ``{"a", "b", "c"}`` in seconds."""
    try:
        path.write_text(json.dumps({k: getattr(model, k) for k in TERMS}, indent=2) + "\n")
    except OSError as exc:
        raise CalibrationError(
            f"--out {str(path)!r}: cannot write it ({exc.strerror}); give a file in a folder that exists and that "
            "you can write, for example --out step_time.json."
        ) from None


def write_measurements(measurements: Iterable[Measurement], path: Path) -> None:
    """Each timed step as a row of a CSV file that ``--from-measurements`` reads."""
    with path.open("w", newline="") as out:
        csv.writer(out).writerows(
            [COLUMNS, *((m.decode_requests, m.prefill_tokens, repr(m.seconds)) for m in measurements)]
        )


def read_measurements(path: Path) -> list[Measurement]:
    """A measurements CSV (``decode_requests,prefill_tokens,seconds``), as ``--measurements`` writes it."""
    try:
        with path.open(newline="") as handle:
            rows = list(csv.reader(handle))
    except OSError as exc:
        raise CalibrationError(
            f"--from-measurements {str(path)!r}: cannot read it ({exc.strerror}); give the CSV file that "
            "--measurements wrote."
        ) from None
    if not rows or rows[0] != COLUMNS:
        raise CalibrationError(
            f"--from-measurements {str(path)!r}: the header is {rows[0] if rows else 'missing'}, not "
            f"{','.join(COLUMNS)}; give the CSV file that --measurements wrote."
        )
    found = []
    for number, row in enumerate(rows[1:], start=2):
        try:
            decode, prefill, seconds = row
            found.append(Measurement(int(decode), int(prefill), float(seconds)))
        except ValueError:
            raise CalibrationError(
                f"{path}, line {number}: {row} is not two whole numbers and a time in seconds, e.g. 8,0,0.004."
            ) from None
    return validated(found)


@dataclass(frozen=True)
class Wave:
    """Requests added together: ``count`` prompts of ``prompt`` tokens, each generating ``output``
    tokens, after ``after_steps`` engine steps of the group's earlier waves."""

    count: int
    prompt: int
    output: int
    after_steps: int = 0


def design(max_num_seqs: int, max_model_len: int) -> list[list[Wave]]:
    """The batches measured, as groups of waves run to completion one group
    after the other: decode-only with 1 to ``max_num_seqs`` requests at a
    short and a long context, prefill-only at several prompt lengths and
    counts, and prefills added to running decodes (mixed steps)."""
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256) if n <= max_num_seqs} | {max_num_seqs})
    long_prompt = max(1, min(384, max_model_len - 64))
    groups = [[Wave(n, 16, min(32, max_model_len - 16))] for n in sizes]
    groups += [[Wave(n, long_prompt, min(32, max_model_len - long_prompt))] for n in sizes[:: max(1, len(sizes) // 3)]]
    lengths = sorted({min(length, max_model_len - 1) for length in (32, 128, 256, 480)})
    groups += [[Wave(k, length, 1)] for length in lengths for k in (1, 4, 16) if k <= max_num_seqs]
    for n in (4, 16, max(1, max_num_seqs * 3 // 4)):
        decoders = [Wave(n, 16, min(48, max_model_len - 16))]
        joins = [Wave(2, min(length, max_model_len - 1), 1, after_steps=4) for length in (128, 400, 64, 256)]
        groups.append(decoders + joins)
    return groups


def _batch(scheduler_output: Any, requests: dict[str, Any]) -> tuple[int, int]:
    """(decoding requests, prompt tokens) of a scheduled batch, read after vLLM
    counted its tokens as computed (as the simulator's executor reads it)."""
    decode = prefill = 0
    for req_id, count in scheduler_output.num_scheduled_tokens.items():
        request = requests[req_id]
        if request.num_computed_tokens - count >= request.num_tokens - 1:
            decode += 1
        else:
            prefill += count
    return decode, prefill


def _timed(core: Any, record: Callable[[int, int, float], None]) -> None:
    """Time each step of vLLM's engine core and read its batch (wrapped on the instance, not the class)."""
    schedule, step = core.scheduler.schedule, core.step_fn
    seen: list[tuple[int, int]] = []

    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        seen.append(_batch(output, core.scheduler.requests))
        return output

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        seen.clear()
        started = time.perf_counter()
        result = step(*args, **kwargs)
        took = time.perf_counter() - started
        if seen and seen[0] != (0, 0):
            record(*seen[0], took)
        return result

    core.scheduler.schedule = timed_schedule
    core.step_fn = timed_step


def measure(args: argparse.Namespace) -> list[Measurement]:
    """Start the engine and run the design ``args.repeats`` times after one warm-up round."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, to time its steps
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model, dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, kv_cache_max_memory=args.kv_cache, **json.loads(args.engine_args),
    )  # fmt: skip
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)
    if core is None or not hasattr(core, "step_fn") or getattr(core, "batch_queue", None) is not None:
        raise CalibrationError(
            "the engine core does not run in this process one batch a step (no batch queue); calibrate times its "
            "steps there: leave out pipeline parallelism and asynchronous scheduling (--engine-args)."
        )
    found: list[Measurement] = []
    keep = [False]
    _timed(core, lambda d, p, s: found.append(Measurement(d, p, s)) if keep[0] else None)
    rng = random.Random(0)
    counter = itertools.count()
    for round_ in range(args.repeats + 1):
        keep[0] = round_ > 0
        for group in design(args.max_num_seqs, args.max_model_len):
            steps = 0
            for wave in group:
                for _ in range(wave.after_steps):
                    if engine.has_unfinished_requests():
                        engine.step()
                        steps += 1
                for _ in range(wave.count):
                    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(wave.prompt)])
                    params = SamplingParams(max_tokens=wave.output, ignore_eos=True, temperature=0)
                    engine.add_request(f"calibrate-{next(counter)}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
        print(f"round {round_} ({'kept' if keep[0] else 'warm-up'}): {len(found)} steps timed", flush=True)
    return found


def parser() -> argparse.ArgumentParser:
    about = "Fit the linear step time t = a + b*decoding + c*prompt_tokens to this machine's engine steps."
    p = argparse.ArgumentParser(prog="vllm-kv-sim calibrate", description=about)
    p.add_argument("--model", help="a local model folder, e.g. models/tiny-llama")
    p.add_argument("--out", type=Path, required=True, help="the JSON file written, e.g. step_time.json")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache", default="64M", help="the engine's --kv-cache-max-memory (default 64M)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the design measured after a warm-up (default 3)")
    p.add_argument(
        "--engine-args", default="{}", help='more LLM(...) keyword arguments as JSON, e.g. {"block_size": 16}'
    )
    p.add_argument("--quantile", type=float, default=QUANTILE, help="of each batch's times fitted (default 0: fastest)")
    p.add_argument("--measurements", type=Path, help="also write each timed step to this CSV file")
    p.add_argument("--from-measurements", type=Path, help="fit a CSV file --measurements wrote; starts no engine")
    return p


def report(result: Fit, points: Sequence[Measurement]) -> str:
    """The fit, its residuals, and each kind of batch's worst relative error."""
    lines = [
        result.model.describe(),
        f"{result.steps} steps in {result.compositions} batch compositions: R^2 {result.r2:.4f}, relative error "
        f"mean {result.mean_rel_error:.1%}, max {result.max_rel_error:.1%} (of each composition's time)",
    ]
    kinds = {
        "decode only": [p for p in points if p.prefill_tokens == 0],
        "prefill only": [p for p in points if p.decode_requests == 0],
        "mixed": [p for p in points if p.decode_requests and p.prefill_tokens],
    }
    for kind, mine in kinds.items():
        if mine:
            errors = relative_errors(result.model, mine)
            worst = max(range(len(mine)), key=lambda i: abs(errors[i]))
            lines.append(
                f"  {kind:<12} {len(mine):>3} compositions, max error {errors[worst]:+.1%} at "
                f"{mine[worst].decode_requests} decoding + {mine[worst].prefill_tokens} prompt tokens "
                f"({mine[worst].seconds * 1000:.2f} ms measured)"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``vllm-kv-sim calibrate ...``: measure (or read) steps, fit, write the JSON; 0 on success, 2 on bad input."""
    args = parser().parse_args(argv)
    try:
        if args.from_measurements is None and not args.model:
            raise CalibrationError("give --model FOLDER (e.g. models/tiny-llama) or --from-measurements FILE.csv.")
        if args.repeats < 1 or args.max_num_seqs < 1 or args.max_model_len < 32:
            raise CalibrationError(
                f"--repeats {args.repeats}, --max-num-seqs {args.max_num_seqs}, --max-model-len "
                f"{args.max_model_len}: give --repeats 1 or more, --max-num-seqs 1 or more and --max-model-len 32 "
                "or more (for example --repeats 3 --max-num-seqs 64 --max-model-len 512)."
            )
        try:
            extra = json.loads(args.engine_args)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            raise CalibrationError(
                f'--engine-args {args.engine_args!r} is not a JSON object; e.g. {{"block_size": 16}}.'
            )
        if args.from_measurements is not None:
            measured = read_measurements(args.from_measurements)
        else:
            measured = measure(args)
            if args.measurements is not None:
                write_measurements(measured, args.measurements)
        result = fit(measured, args.quantile)
        write_model(result.model, args.out)
    except (CalibrationError, StepTimeError) as exc:
        print(f"vllm-kv-sim calibrate: error: {exc}", file=sys.stderr)
        return 2
    print(report(result, per_composition(measured, args.quantile)))
    print(f"wrote {args.out} (vllm-kv-sim --step-time {args.out})")
    return 0
