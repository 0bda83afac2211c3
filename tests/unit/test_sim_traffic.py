"""vllm-kv-sim's traffic and step-time settings: the Azure traces read by
path with their checksum, sliced, time-scaled and mapped onto a model's
length; Poisson and gamma arrivals; the linear step time's input. Pure: no vLLM."""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

import pytest

from vllm_kv_cache_limit.sim import traffic
from vllm_kv_cache_limit.sim.step_time import Batch, LinearStepTime, StepTimeError, parse_linear

ROWS = [
    ("2023-11-16 18:15:46.6805900", 374, 44),
    ("2023-11-16 18:15:50.9951690", 396, 109),
    ("2023-11-16 18:16:46.7000000", 3000, 20),
    ("2023-11-16 18:17:10.6805900", 50, 2000),
    ("2023-11-16 18:17:50.6805900", 10, 10),
]


def _trace(folder: Path, rows: list[tuple[str, int, int]] = ROWS) -> Path:
    """A trace in the Azure traces' format, with its SHA256SUMS beside it."""
    path = folder / traffic.AZURE_FILES["conv"]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / traffic.CHECKSUMS).write_text(f"{digest}  {path.name}\n")
    return path


def test_a_slice_is_timed_from_its_start_scaled_and_capped(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    whole = traffic.load_azure(path)
    assert [(round(a.at, 3), a.prompt_tokens, a.output_tokens) for a in whole] == [
        (0.0, 374, 44),
        (4.315, 396, 109),
        (60.019, 3000, 20),
        (84.0, 50, 2000),
        (124.0, 10, 10),
    ]
    # Minute 1 for one minute, twice as fast, onto a model of 1024 tokens with prompts halved.
    tokens = traffic.Tokens(prompt_scale=0.5, max_total=1024)
    sliced = traffic.load_azure(path, start_min=1.0, minutes=1.0, time_scale=2.0, tokens=tokens)
    assert [(round(a.at, 4), a.prompt_tokens, a.output_tokens) for a in sliced] == [
        (0.0097, 1023, 1),  # 1500 prompt tokens capped to leave one output token
        (12.0, 25, 999),  # the output cut to fit max_model_len
    ]


def test_a_trace_that_differs_from_its_checksum_is_refused(tmp_path: Path) -> None:
    path = _trace(tmp_path)
    path.write_text(path.read_text().replace("374", "375"))
    with pytest.raises(traffic.TrafficError, match="is not the published one: its SHA-256 is [0-9a-f]{64}"):
        traffic.load_azure(path)
    (tmp_path / traffic.CHECKSUMS).unlink()
    with pytest.raises(traffic.TrafficError, match="has no checksum to check it against"):
        traffic.load_azure(path)


def test_gamma_arrivals_are_burstier_than_poisson_at_the_same_rate() -> None:
    poisson = traffic.poisson(10.0, 600.0, 100, 10, seed=3)
    bursty = traffic.gamma(10.0, 4.0, 600.0, 100, 10, seed=3)

    def cv(arrivals: list[traffic.Arrival]) -> float:
        gaps = [b.at - a.at for a, b in zip(arrivals, arrivals[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert len(poisson) == pytest.approx(6000, rel=0.05) and len(bursty) == pytest.approx(6000, rel=0.25)
    assert cv(poisson) == pytest.approx(1.0, abs=0.1) and cv(bursty) == pytest.approx(4.0, rel=0.25)
    assert traffic.poisson(10.0, 600.0, 100, 10, seed=3) == poisson  # seeded: the same run twice
    with pytest.raises(traffic.TrafficError, match="give positive numbers"):
        traffic.gamma(0.0, 1.0, 10.0, 100, 10)


def test_the_linear_step_time_reads_constants_or_json_and_says_what_would_work(tmp_path: Path) -> None:
    model = parse_linear("a=0.01,b=0.001,c=0.0001")
    assert model.seconds(Batch(decode_requests=4, prefill_tokens=100, prefill_requests=1)) == pytest.approx(0.024)
    assert model.seconds(Batch()) == 0.0  # no model runs for an empty step
    (tmp_path / "fit.json").write_text('{"a": 0.01, "b": 0.001, "c": 0.0001}')
    assert parse_linear(str(tmp_path / "fit.json")) == model
    for bad, quoted in (("a=0.01,d=1", "'d=1'"), ("a=x", "'x'"), ("a=-1", "-1.0")):
        with pytest.raises(StepTimeError) as caught:
            parse_linear(bad)
        message = str(caught.value)
        assert quoted in message and "for example" in message
        suggestion = message.rsplit("for example ", 1)[1].rstrip(".)").split(" ")[0]
        parse_linear(suggestion if "=" in suggestion else "a=0.005")  # what it suggests is accepted
    with pytest.raises(StepTimeError, match="0 for every batch"):
        LinearStepTime(0, 0, 0)


PUBLISHED = {
    "AzureLLMInferenceTrace_code.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    "AzureLLMInferenceTrace_conv.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
}
"""The SHA-256 of the Azure traces 2023 as published (docs/simulate.md)."""


def test_the_package_ships_the_azure_traces_with_their_checksums_and_attribution() -> None:
    folder = traffic.TRACES
    assert folder.parent == Path(traffic.__file__).parent  # inside the package, so in the wheel
    sums = {
        name: digest
        for digest, name in (line.split() for line in (folder / traffic.CHECKSUMS).read_text().splitlines())
    }
    assert sums == PUBLISHED
    for name, digest in PUBLISHED.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
    readme = (folder / "README.md").read_text()
    assert all(words in readme for words in ("Splitwise", "ISCA 2024", "Azure/AzurePublicDataset", "CC-BY 4.0"))
    # The first minute of each, read from the package without a folder given.
    conv = traffic.load_azure(traffic.trace_path(None, "conv"), minutes=1.0)
    code = traffic.load_azure(traffic.trace_path(None, "code"), minutes=1.0)
    assert traffic.trace_path(None, "conv") == folder / traffic.AZURE_FILES["conv"]
    assert len(conv) > 100 and len(code) > 10 and conv[0].at == 0.0 and max(a.at for a in conv) < 60.0


def test_the_cli_replays_the_packaged_traces_unless_a_folder_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_kv_cache_limit.sim import cli

    monkeypatch.delenv(cli.TRACE_DIR_ENV, raising=False)
    values = {"model": "m", "max_model_len": 1024, "trace": "conv"}
    packaged = cli._traffic(values, cli.parser().parse_args(["--instance", "x", "--budget", "1M"]))
    assert packaged == traffic.load_azure(traffic.TRACES / traffic.AZURE_FILES["conv"], minutes=1.0,
                                          tokens=traffic.Tokens(max_total=1024))  # fmt: skip
    # A folder of its own ($VLLM_KV_SIM_TRACES or --trace-dir) replaces it, checked the same way.
    _trace(tmp_path)
    monkeypatch.setenv(cli.TRACE_DIR_ENV, str(tmp_path))
    own = cli._traffic(values, cli.parser().parse_args(["--instance", "x", "--budget", "1M"]))
    assert [a.prompt_tokens for a in own] == [374, 396]  # the first minute of its own trace
    # A packaged copy that differs from its SHA256SUMS is refused, not replayed.
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for name in (*PUBLISHED, traffic.CHECKSUMS):
        (tampered / name).write_bytes((traffic.TRACES / name).read_bytes())
    conv = tampered / traffic.AZURE_FILES["conv"]
    conv.write_text(conv.read_text().replace(",374,", ",375,", 1))
    monkeypatch.setattr(traffic, "TRACES", tampered)
    monkeypatch.delenv(cli.TRACE_DIR_ENV)
    with pytest.raises(traffic.TrafficError, match="is not the published one"):
        cli._traffic(values, cli.parser().parse_args(["--instance", "x", "--budget", "1M"]))
