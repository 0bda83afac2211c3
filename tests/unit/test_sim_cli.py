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
        "--scenarios", "even,autoscale",
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
        (["--budget", "4M", "--overlap", "2"], "--overlap 2.0: give a fraction from 0"),
        (["--budget", "4M", "--device-memory", "lots"], "--device-memory 'lots'"),
        (["--budget", "4M", "--scenarios", "no-cap"], "give --device-memory"),
        (["--budget", "4M", "--device-memory", "72M", "--scenarios", "even"], "at most --budget 2.02MiB"),
        (["--budget", "4M", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0.0: give one in (0, 1]"),
        (["--budget", "4M", "--system", "tpu", "--instance", "model=m,max_model_len=8,aiconfigurator=X"], "'tpu'"),
    ],
)
def test_bad_input_is_refused_quoting_it(
    tiny_model: str, capsys: pytest.CaptureFixture[str], args: list[str], quoted: str
) -> None:
    code, _, err = _run(
        capsys, "--instance", f"model={tiny_model},max_model_len=1024,rate=1", "--minutes", "0.05", *args
    )
    assert code == 2 and quoted in err, err


def test_plot_progress_and_all_scenarios_with_the_device_memory(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --device-memory no-cap runs too (its second instance does not
    start: vLLM's error in the JSON); --plot writes one PNG per scenario
    whose instances started, --progress a bar of simulated seconds on stderr."""
    instance = f"model={tiny_model},max_model_len=1024,rate=4,prompt=300,output=30"
    code, out, err = _run(
        capsys, "--instance", f"name=a,{instance}", "--instance", f"name=b,{instance},seed=3", "--minutes", "0.4",
        "--budget", "4M", "--device-memory", "256M", "--plot", str(tmp_path / "t.png"), "--progress", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert [s["scenario"] for s in report["scenarios"]] == ["no-cap", "even", "plan", "autoscale", "oracle"]
    no_cap = report["scenarios"][0]["instances"]
    assert "error" not in no_cap["a"] and "Free memory on device" in no_cap["b"]["error"]
    for name in ("no-cap", "even", "plan", "autoscale", "oracle"):
        png = tmp_path / f"t-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    for name in ("no-cap", "autoscale", "oracle"):  # a bar per scenario, of the seconds up to the last arrival
        assert f"\r{name}:" in err and "/24.0 [" in err
    code, out, err = _run(
        capsys, "--instance", f"name=a,{instance}", "--minutes", "0.1", "--budget", "4M", "--plot",
        str(tmp_path / "u.png"),
    )  # fmt: skip
    # Without --device-memory every scenario but no-cap (vLLM's sizing needs the device's memory); no bar
    # without --progress, stderr being no terminal.
    assert code == 0 and "oracle" in out and "no-cap" not in out and "oracle" not in err
    assert sorted(p.name for p in tmp_path.glob("u-*.png")) == [
        f"u-{n}.png" for n in ("autoscale", "even", "oracle", "plan")
    ]


def test_recommend_runs_a_small_search_and_prints_accepted_flags(
    tiny_model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bursting and a steady instance: the search tries the even split, a
    split by tokens and autoscaling settings, at most MAX_RUNS runs; the best
    has the highest goodput, and its flags give exactly the sizes it ran with."""
    from vllm_kv_cache_limit.logic.sizes import parse_size
    from vllm_kv_cache_limit.sim.recommend import MAX_RUNS

    code, out, err = _run(
        capsys, "--instance", f"name=burst,model={tiny_model},max_model_len=1024,trace=gamma,rate=6,cv=3,prompt=400",
        "--instance", f"name=steady,model={tiny_model},max_model_len=1024,rate=1,prompt=100,output=20",
        "--minutes", "0.3", "--budget", "6M", "--scenarios", "even", "--recommend", "--json",
    )  # fmt: skip
    assert code == 0, err
    found = json.loads(out)["recommendation"]
    searched = [c for c in found["searched"] if "refused" not in c]
    assert 3 <= len(found["searched"]) <= MAX_RUNS and {c["kind"] for c in searched} == {"static", "autoscale"}
    best = found["best"]
    assert best["goodput_req_s"] == max(c["goodput_req_s"] for c in searched)
    for index, name in enumerate(("burst", "steady")):
        words = found["flags"][name].split()
        size = parse_size(words[words.index("--kv-cache-max-memory") + 1])
        if best["kind"] == "static":
            assert size == best["caps"][index]
        else:
            assert size == 6 << 20 and "--kv-cache-autoscale" in words
    code, out, _ = _run(
        capsys, "--instance", f"name=a,model={tiny_model},max_model_len=1024,rate=1", "--minutes", "0.1",
        "--budget", "4M", "--scenarios", "even", "--recommend",
    )  # fmt: skip
    assert code == 0 and "recommended (one command per instance):" in out and "a: vllm serve " in out
    # A budget of 3M for two instances of max_model_len 1024 (1 MiB a request): half the even share as the
    # floor is below one request, the plugin refuses it; the search says so and goes on.
    rate = f"model={tiny_model},max_model_len=1024,prompt=300,output=20"
    code, out, err = _run(
        capsys, "--instance", f"name=a,{rate},rate=3", "--instance", f"name=b,{rate},rate=1,seed=4", "--minutes", "0.1",
        "--budget", "3M", "--scenarios", "even", "--recommend", "--json",
    )  # fmt: skip
    assert code == 0, err
    found = json.loads(out)["recommendation"]
    refused = [c["refused"] for c in found["searched"] if "refused" in c]
    assert any("--kv-cache-min-memory 768KiB is refused" in r for r in refused), found["searched"]
    assert "refused" not in found["best"]


def test_calibrate_is_dispatched_to_its_module(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys
    import types

    from vllm_kv_cache_limit.sim.cli import CALIBRATE

    seen: list[list[str]] = []
    stub = types.ModuleType(CALIBRATE)

    def calibrate_main(argv: list[str]) -> int:
        seen.append(argv)
        return 5

    stub.main = calibrate_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, CALIBRATE, stub)
    assert main(["calibrate", "--model", "m", "--out", "x.json"]) == 5
    assert seen == [["--model", "m", "--out", "x.json"]]
    monkeypatch.setitem(sys.modules, CALIBRATE, None)  # as if the module were not there
    code, _, err = _run(capsys, "calibrate", "--model", "m")
    assert code == 2 and "calibrate is not in this version" in err
