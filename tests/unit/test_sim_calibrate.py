"""``vllm-kv-sim calibrate``'s fit and files, on injected measurements (no
engine): a known step time plus noise is recovered and predicts batches it
was not fitted on; the JSON it writes is what ``--step-time FILE`` reads;
bad input is refused with a message that quotes it. The batch of each
step is read from vLLM's real scheduler (the simulator's engine core, its
executor replaced)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from vllm_kv_cache_limit.sim import calibrate
from vllm_kv_cache_limit.sim.calibrate import CalibrationError, Measurement, fit
from vllm_kv_cache_limit.sim.step_time import Batch, LinearStepTime, parse_linear

A, B, C = 0.004, 0.0003, 0.00002
"""4 ms a step, 0.3 ms a decoding request, 0.02 ms a prompt token."""
TRUE = LinearStepTime(A, B, C)


def _measured(
    compositions: list[tuple[int, int]], noise: float = 0.03, repeats: int = 5, seed: int = 0, model=TRUE
) -> list[Measurement]:
    """Each composition timed ``repeats`` times by ``model``, each slowed by a
    relative delay drawn from a half-normal (contention only adds time)."""
    rng = random.Random(seed)
    return [
        Measurement(d, p, model.seconds(Batch(d, p)) * (1 + abs(rng.gauss(0, noise))))
        for d, p in compositions
        for _ in range(repeats)
    ]


DECODES = [(n, 0) for n in (1, 2, 4, 8, 16, 32, 64)]
PREFILLS = [(0, p) for p in (32, 128, 256, 480, 1920)]
MIXED = [(n, p) for n in (4, 16, 48) for p in (128, 400)]


def test_known_step_time_plus_noise_is_recovered() -> None:
    result = fit(_measured(DECODES + PREFILLS + MIXED))
    assert (result.model.a, result.model.b, result.model.c) == pytest.approx((A, B, C), rel=0.05)
    assert result.r2 > 0.99 and result.max_rel_error < 0.05
    assert result.compositions == len(DECODES + PREFILLS + MIXED) and result.steps == 5 * result.compositions


def test_fit_predicts_batches_it_was_not_fitted_on() -> None:
    """The validation's premise on a small scale: fitted on decode-only and
    prefill-only steps, the model predicts mixed steps (held out) within 5%."""
    result = fit(_measured(DECODES + PREFILLS, seed=1))
    held_out = calibrate.per_composition(_measured(MIXED, seed=2), 0.5)
    errors = calibrate.relative_errors(result.model, held_out)
    assert max(abs(e) for e in errors) < 0.05, errors


def test_a_slow_step_now_and_then_moves_the_fit_little() -> None:
    """A shared machine slows a step now and then: one step in five 10x slower
    leaves each composition's fastest, lower quartile and median, and so the fit, where it was."""
    steps = _measured(DECODES + PREFILLS, noise=0.01, seed=3)
    slowed = [Measurement(m.decode_requests, m.prefill_tokens, m.seconds * (10 if i % 5 == 0 else 1))
              for i, m in enumerate(steps)]  # fmt: skip
    for quantile in (0.0, 0.25, 0.5):
        result = fit(slowed, quantile)
        assert (result.model.a, result.model.b, result.model.c) == pytest.approx((A, B, C), rel=0.05)


def test_a_coefficient_that_would_be_negative_is_0() -> None:
    """No fixed cost per step (a = 0) with noise: the unconstrained fit's a
    can fall below 0, which --step-time refuses; the fit keeps a >= 0."""
    zero_a = LinearStepTime(0.0, B, C)
    for seed in range(10):
        result = fit(_measured(DECODES + PREFILLS, noise=0.05, seed=seed, model=zero_a))
        assert result.model.a >= 0 and result.model.b == pytest.approx(B, rel=0.1)
        assert result.model.c == pytest.approx(C, rel=0.1)


def test_json_round_trip_through_step_time(tmp_path: Path) -> None:
    result = fit(_measured(DECODES + PREFILLS + MIXED))
    path = tmp_path / "step_time.json"
    calibrate.write_model(result.model, path)
    assert set(json.loads(path.read_text())) == {"a", "b", "c"}
    assert parse_linear(str(path)) == result.model


def test_command_fits_measurements_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = tmp_path / "steps.csv"
    calibrate.write_measurements(_measured(DECODES + PREFILLS + MIXED, seed=4), steps)
    out = tmp_path / "step_time.json"
    assert calibrate.main(["--from-measurements", str(steps), "--out", str(out)]) == 0
    model = parse_linear(str(out))
    assert (model.a, model.b, model.c) == pytest.approx((A, B, C), rel=0.05)
    printed = capsys.readouterr().out
    assert "R^2 " in printed and "decode only" in printed and "prefill only" in printed and "mixed" in printed


@pytest.mark.parametrize(
    ("measurements", "says"),
    [
        ([], "0 batch composition(s), none with a decoding request"),
        ([Measurement(n, 0, 0.004 + n * B) for n in (1, 2, 4)] * 2, "none with prompt tokens"),
        ([Measurement(1, 0, 0.004), Measurement(0, 64, 0.005), Measurement(2, 0, 0.0046)], "at least 4 different"),
        ([Measurement(1, 0, -0.004)], "Measurement(decode_requests=1, prefill_tokens=0, seconds=-0.004)"),
        ([Measurement(1, 0, float("nan"))], "seconds=nan"),
        ([Measurement(0, 0, 0.004)], "schedules nothing"),
        ([Measurement(-1, 0, 0.004)], "decode_requests=-1"),
    ],
)
def test_bad_measurements_are_refused(measurements: list[Measurement], says: str) -> None:
    with pytest.raises(CalibrationError) as caught:
        fit(measurements)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("decode,prefill,t\n1,0,0.004\n", "the header is ['decode', 'prefill', 't']"),
        ("decode_requests,prefill_tokens,seconds\n1,zero,0.004\n", "line 2: ['1', 'zero', '0.004']"),
        ("decode_requests,prefill_tokens,seconds\n1,0\n", "line 2: ['1', '0']"),
        ("decode_requests,prefill_tokens,seconds\n1,0,0\n", "seconds=0.0"),
        ("", "the header is missing"),
    ],
)
def test_bad_measurements_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, says: str
) -> None:
    steps = tmp_path / "steps.csv"
    steps.write_text(content)
    out = tmp_path / "step_time.json"
    assert calibrate.main(["--from-measurements", str(steps), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("vllm-kv-sim calibrate: error: ") and says in error
    assert not out.exists()  # nothing half written


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--out", "x.json"], "give --model FOLDER"),
        (["--model", "m", "--out", "x.json", "--repeats", "0"], "--repeats 0"),
        (
            ["--from-measurements", "steps.csv", "--out", "x.json", "--quantile", "50"],
            "--quantile 50.0: give a fraction",
        ),
        (["--model", "m", "--out", "x.json", "--engine-args", "[1]"], "--engine-args '[1]' is not a JSON object"),
        (["--from-measurements", "/nonexistent/steps.csv", "--out", "x.json"], "'/nonexistent/steps.csv': cannot read"),
    ],
)
def test_bad_arguments_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    calibrate.write_measurements(_measured(DECODES + PREFILLS), tmp_path / "steps.csv")
    assert calibrate.main(argv) == 2
    assert says in capsys.readouterr().err


def test_unwritable_out_is_refused_and_the_suggestion_is_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = tmp_path / "steps.csv"
    calibrate.write_measurements(_measured(DECODES + PREFILLS), steps)
    bad = tmp_path / "missing" / "step_time.json"
    assert calibrate.main(["--from-measurements", str(steps), "--out", str(bad)]) == 2
    error = capsys.readouterr().err
    assert f"--out {str(bad)!r}: cannot write it" in error and "--out step_time.json" in error
    monkeypatch.chdir(tmp_path)
    assert calibrate.main(["--from-measurements", str(steps), "--out", "step_time.json"]) == 0
    assert parse_linear(str(tmp_path / "step_time.json")).b > 0


def test_each_step_is_read_from_vllms_scheduler(tiny_model: str) -> None:
    """The batch of each timed step, as vLLM's real scheduler schedules it:
    two prompts of 20 tokens prefilled together, then decoded; a third
    request's prefill (30 tokens) joins two decodes in a mixed step."""
    pytest.importorskip("vllm")
    from vllm_kv_cache_limit.sim.clock import VirtualClock
    from vllm_kv_cache_limit.sim.instance import Instance, InstanceSpec, SimExecutor, build_engine_core
    from vllm_kv_cache_limit.sim.traffic import Arrival

    spec = InstanceSpec("calibrated", tiny_model, 256, 16)
    executor = SimExecutor(VirtualClock(), TRUE)
    core = build_engine_core(spec, 1 << 22, executor)
    instance = Instance(spec, core, executor, [Arrival(0.0, 20, 4), Arrival(0.0, 20, 4), Arrival(1.0, 30, 2)])

    def step() -> Any:  # as EngineCore.__init__ sets step_fn; each step starts where the clock is
        executor.started_at = executor.clock.now
        return core.step()

    core.step_fn = step
    timed: list[tuple[int, int, float]] = []
    calibrate._timed(core, lambda d, p, s: timed.append((d, p, s)))
    instance.admit(0.0)
    core.step_fn()
    core.step_fn()
    instance.admit(1.0)
    while core.scheduler.has_requests():
        core.step_fn()
    assert [(d, p) for d, p, _ in timed] == [(0, 40), (2, 0), (2, 30), (3, 0)]
    assert all(seconds > 0 for _, _, seconds in timed)
