"""``vllm-kv-sim`` end to end: two instances of the tiny Llama on 30 s of
Azure-format traffic, the even split and the shared budget side by side,
with the linear step time; bad input refused with what would work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.unit.test_sim_traffic import _trace  # noqa: E402
from vllm_kv_cache_limit.sim import main, traffic  # noqa: E402

AZURE = Path(os.environ.get("VLLM_KV_SIM_TRACES", "/work/shared/data/azure-llm-2023"))


def _rows(seconds: int) -> list[tuple[str, int, int]]:
    """A request every 0.25 s for ``seconds``, prompts of 300-1200 tokens, outputs of 20-80."""
    return [
        (f"2023-11-16 18:15:{n // 4 + 10:02d}.{(n % 4) * 25:02d}00000", 300 + (n * 97) % 900, 20 + (n * 31) % 60)
        for n in range(seconds * 4)
    ]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_scenarios_run_side_by_side_on_a_30_s_slice(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _trace(tmp_path, _rows(40))
    instance = f"model={tiny_model},max_model_len=1024,trace=conv"
    code, out, err = _run(
        capsys,
        "--instance", f"name=conv,{instance}",
        "--instance", f"name=late,{instance},start_min=0.25",
        "--trace-dir", str(tmp_path), "--minutes", "0.5", "--budget", "4M", "--shrink-after", "2", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert [s["scenario"] for s in report["scenarios"]] == ["even", "autoscale"]
    for scenario in report["scenarios"]:
        conv, late = scenario["instances"]["conv"], scenario["instances"]["late"]
        # 30 s of the 40 s trace; the late one's slice from 15 s to its end (25 s).
        assert conv["requests"] == 120 and late["requests"] == 100
        for figures in (conv, late):
            assert figures["finished"] == figures["requests"]
            assert 0 < figures["ttft_s"]["p50"] <= figures["ttft_s"]["p90"] <= figures["ttft_s"]["p99"]
            assert figures["tpot_s"]["p50"] > 0 and figures["goodput_req_s"] > 0
    even, shared = report["scenarios"]
    assert even["instances"]["conv"]["limit_changes"] is None and shared["instances"]["conv"]["limit_changes"] > 0
    code, out, _ = _run(
        capsys, "--instance", f"name=conv,{instance}", "--trace-dir", str(tmp_path), "--minutes", "0.5",
        "--budget", "4M",
    )  # fmt: skip
    assert code == 0 and "autoscale  conv" in out and "goodput" in out


@pytest.mark.skipif(not (AZURE / traffic.CHECKSUMS).exists(), reason=f"the Azure traces are not in {AZURE}")
def test_the_azure_conversation_trace_replays_for_30_s(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys, "--instance", f"model={tiny_model},max_model_len=1024,trace=conv,prompt_scale=0.25",
        "--trace-dir", str(AZURE), "--minutes", "0.5", "--budget", "8M", "--json",
    )  # fmt: skip
    assert code == 0, err
    figures = [s["instances"]["i0"] for s in json.loads(out)["scenarios"]]
    assert all(f["requests"] > 20 and f["finished"] == f["requests"] for f in figures)


@pytest.mark.parametrize(
    ("args", "quoted"),
    [
        (["--budget", "lots"], "--budget 'lots'"),
        (["--budget", "4M", "--scenarios", "best"], "--scenarios 'best'"),
        (["--budget", "64K"], "fewer than one request of max_model_len 1024"),
    ],
)
def test_bad_input_is_refused_quoting_it(
    tiny_model: str, capsys: pytest.CaptureFixture[str], args: list[str], quoted: str
) -> None:
    code, _, err = _run(
        capsys, "--instance", f"model={tiny_model},max_model_len=1024,rate=1", "--minutes", "0.05", *args
    )
    assert code == 2 and quoted in err, err
