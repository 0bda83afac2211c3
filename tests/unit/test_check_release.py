"""``make check-release`` (``scripts/check_release.py``): every step runs
whatever the ones before did, the table names each with its result, and the
exit status is 1 when any failed; and how ``scripts/vllm_own_tests.py``
compares the two runs of vLLM's own tests. Steps stubbed: no network, no vLLM."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look the module up
    try:
        spec.loader.exec_module(module)
    finally:
        monkeypatch.undo()
    return module


@pytest.fixture(scope="module")
def release() -> ModuleType:
    return load_script("check_release")


@pytest.fixture(scope="module")
def own() -> ModuleType:
    return load_script("vllm_own_tests")


def ticking(step_s: float = 2.0) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += step_s


def stub_steps(release: ModuleType, calls: list[str]) -> list:
    def passing() -> tuple[bool, str]:
        calls.append("hooks")
        return True, "all 5 groups fit"

    def failing() -> tuple[bool, str]:
        calls.append("cuda")
        return False, "2 failed, 28 passed in 60.0s"

    def raising() -> tuple[bool, str]:
        calls.append("own")
        raise RuntimeError("no .venv-cuda-9.9.9")

    def last() -> tuple[bool, str]:
        calls.append("patch")
        return True, "vllm-0.33.0.patch applies"

    return [
        release.Step("hooks and attributes", passing),
        release.Step("CUDA-wheel tier", failing),
        release.Step("vLLM's own tests, plugin unused", raising),
        release.Step("upstream patch", last),
    ]


def test_every_step_runs_after_a_failure_and_the_status_is_1(release: ModuleType) -> None:
    calls: list[str] = []
    clock = ticking()
    results = release.run_steps(stub_steps(release, calls), clock=lambda: next(clock))
    assert calls == ["hooks", "cuda", "own", "patch"]
    assert [(r.ok, r.seconds) for r in results] == [(True, 2.0), (False, 2.0), (False, 2.0), (True, 2.0)]
    assert results[2].detail == "RuntimeError: no .venv-cuda-9.9.9"
    assert release.exit_status(results) == 1
    assert release.exit_status([results[0], results[3]]) == 0


def test_the_table_has_one_row_per_step_with_result_seconds_and_detail(release: ModuleType) -> None:
    results = [
        release.Result("hooks and attributes", True, 12.4, "all 5 groups fit"),
        release.Result("CUDA-wheel tier", False, 61.0, "2 failed, 28 passed in 60.0s"),
    ]
    lines = release.table(results).splitlines()
    assert re.fullmatch(r"step +result +seconds +detail", lines[0])
    assert re.fullmatch(r"hooks and attributes +ok +12  all 5 groups fit", lines[1])
    assert re.fullmatch(r"CUDA-wheel tier +FAIL +61  2 failed, 28 passed in 60.0s", lines[2])
    # The columns line up.
    assert lines[0].index("result") == lines[1].index(" ok ") + 1 == lines[2].index(" FAIL ") + 1


@pytest.mark.parametrize("fail", [False, True])
def test_main_prints_the_table_last_and_exits_by_the_results(
    release: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fail: bool
) -> None:
    steps = stub_steps(release, [])
    chosen = steps if fail else [steps[0], steps[3]]
    monkeypatch.setattr(release, "steps", lambda version: chosen)
    assert release.main(["9.9.9"]) == (1 if fail else 0)
    out = capsys.readouterr().out.rstrip().splitlines()
    rows = out[-len(chosen) :]
    assert [row.split("  ")[0] for row in rows] == [step.name for step in chosen]
    summary = "2 of 4 checks passed" if fail else "2 of 2 checks passed"
    assert out[-len(chosen) - 2] == f"vLLM 9.9.9: {summary}"


def test_the_details_of_the_commands(release: ModuleType) -> None:
    hooks = [
        "OK   wheel vllm-9.9.9.whl vLLM 9.9.9: all 40 hooks fit",
        "FAIL wheel vllm-9.9.9.whl vLLM 9.9.9: 2 of 12 attributes do not fit:",
        "  - CacheConfig.num_gpu_blocks: missing",
    ]
    assert release.hooks_detail(1, hooks) == "1 of 2 groups do not fit: 2 of 12 attributes do not fit"
    assert release.hooks_detail(0, hooks[:1]).startswith("all 1 groups fit")
    assert release.hooks_detail(3, []) == "the wheel could not be fetched"
    pytest_out = ["...", "======= 2 failed, 28 passed, 1 skipped in 61.20s (0:01:01) ========", "make: *** Error 1"]
    assert release.pytest_detail(1, pytest_out) == "2 failed, 28 passed, 1 skipped in 61.20s (0:01:01)"
    assert release.pytest_detail(2, ["make: *** No rule", ""]) == "make: *** No rule"


def test_the_patch_is_the_release_own_else_the_newest_earlier_one(release: ModuleType, tmp_path: Path) -> None:
    for name in ("vllm-0.32.0.patch", "vllm-0.33.0.patch", "vllm-0.35.0.patch", "vllm-next.patch"):
        (tmp_path / name).write_text("")
    assert release.patch_for("0.34.0", tmp_path).name == "vllm-0.33.0.patch"
    assert release.patch_for("0.35.0", tmp_path).name == "vllm-0.35.0.patch"
    assert release.patch_for("0.32.1", tmp_path).name == "vllm-0.32.0.patch"
    assert release.patch_for("0.31.0", tmp_path) is None


def outcomes_run(own: ModuleType, label: str, outcomes: dict[str, str], installed: bool) -> Any:
    return own.Run(label, outcomes, {k: "why" for k, v in outcomes.items() if v != "passed"}, {"installed": installed})


def test_the_runs_are_compared_test_by_test(own: ModuleType) -> None:
    without = outcomes_run(own, "without", {"a": "passed", "b": "failed", "c": "skipped", "d": "passed"}, False)
    same = outcomes_run(own, "with", dict(without.outcomes), True)
    assert own.differences(without, same) == []
    assert own.counts(without.outcomes) == "2 passed, 1 failed, 1 skipped"
    other = outcomes_run(own, "with", {"a": "passed", "b": "failed", "c": "passed", "e": "error"}, True)
    assert own.differences(without, other) == [
        "c: skipped without the plugin, passed with it (why)",
        "d: passed without the plugin, absent with it",
        "e: absent without the plugin, error with it (why)",
    ]


def test_a_comparison_with_the_plugin_off_in_both_runs_proves_nothing(own: ModuleType) -> None:
    off = outcomes_run(own, "without", {"a": "passed"}, False)
    on = outcomes_run(own, "with", {"a": "passed"}, True)
    own.check_plugin_states(off, on)
    with pytest.raises(own.RunError, match="installed no hooks"):
        own.check_plugin_states(off, off)
    with pytest.raises(own.RunError, match='VLLM_PLUGINS=""'):
        own.check_plugin_states(on, on)


def _python_and_source(tmp_path: Path, version: str) -> tuple[Path, Path]:
    """A stand-in interpreter path and where vLLM ``version``'s source would be unpacked."""
    python = tmp_path / "python"
    python.write_text("")
    return python, tmp_path / f"vllm-{version}"


def test_main_exits_1_and_lists_the_tests_that_differ(
    own: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python, root = _python_and_source(tmp_path, "9.9.9")
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_a.py").write_text("")
    monkeypatch.setattr(own, "download_sdist", lambda version, sdists: tmp_path / "vllm-9.9.9.tar.gz")
    monkeypatch.setattr(own, "extract_tests", lambda sdist, dest: root)
    monkeypatch.setattr(own, "environment_versions", lambda p: {"vllm": "9.9.9", "vllm-kv-cache-limit": "0.1.0"})
    monkeypatch.setattr(own, "ensure_requirements", lambda p: None)
    results = {
        "": outcomes_run(own, "without-plugin", {"t::a": "passed", "t::b": "failed"}, False),
        None: outcomes_run(own, "with-plugin", {"t::a": "failed", "t::b": "failed"}, True),
    }
    monkeypatch.setattr(own, "run_tests", lambda py, root, files, plugins, label, logs: results[plugins])
    assert own.main(["9.9.9", "tests/test_a.py", "--python", str(python)]) == own.EXIT_DIFFERENT
    out = capsys.readouterr().out
    assert "  - t::a: passed without the plugin, failed with it (why)" in out
    assert out.rstrip().splitlines()[-1].startswith("1 of 2 tests differ")
    results[None] = outcomes_run(own, "with-plugin", {"t::a": "passed", "t::b": "failed"}, True)
    assert own.main(["9.9.9", "tests/test_a.py", "--python", str(python)]) == 0
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith("same outcome for all 2 tests with and without the plugin (1 passed, 1 failed)")
    )


def test_a_release_runs_the_files_it_has_and_skips_those_new_in_a_later_one(own: ModuleType, tmp_path: Path) -> None:
    root = tmp_path / "vllm-0.33.0"
    older = [f.path for f in own.TEST_FILES if f.since is None]
    newer = [f for f in own.TEST_FILES if f.since is not None]
    assert "tests/v1/worker/test_extensible_kv_cache.py" in [f.path for f in newer]
    for path in older:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("")
    files, left_out = own.release_files("0.33.0", root)
    assert files == older
    assert left_out == [f"{f.path} (new in vLLM {f.since})" for f in newer]
    assert own.release_files("0.34.0", root) == ([f.path for f in own.TEST_FILES], [])
    # A file listed as new in a later release but there after all: its since is wrong.
    (root / newer[0].path).parent.mkdir(parents=True, exist_ok=True)
    (root / newer[0].path).write_text("")
    with pytest.raises(own.RunError, match="correct its since"):
        own.release_files("0.33.0", root)


def test_a_file_the_release_should_have_and_lacks_fails_the_step(
    own: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    python, root = _python_and_source(tmp_path, "0.33.0")
    for test_file in own.TEST_FILES[1:]:
        if test_file.since is None:
            (root / test_file.path).parent.mkdir(parents=True, exist_ok=True)
            (root / test_file.path).write_text("")
    monkeypatch.setattr(own, "download_sdist", lambda version, sdists: tmp_path / "vllm-0.33.0.tar.gz")
    monkeypatch.setattr(own, "extract_tests", lambda sdist, dest: root)
    monkeypatch.setattr(own, "environment_versions", lambda p: {"vllm": "0.33.0", "vllm-kv-cache-limit": "0.1.0"})
    monkeypatch.setattr(own, "ensure_requirements", lambda p: None)
    monkeypatch.setattr(own, "run_tests", lambda *args: pytest.fail("ran without a file the release should have"))
    assert own.main(["0.33.0", "--python", str(python)]) == own.EXIT_NO_RUN
    out = capsys.readouterr().out
    assert f"has no {own.TEST_FILES[0].path}" in out.splitlines()[-1]
    assert "skipped tests/v1/worker/test_extensible_kv_cache.py (new in vLLM 0.34): not in vLLM 0.33.0" in out


def test_the_sdist_address_is_read_from_pip(own: ModuleType) -> None:
    output = (
        "  Found link https://files.example/packages/92/vllm-0.33.0.tar.gz (from https://example/simple/vllm/), version: 0.33.0\n"
        "  Found link https://files.example/packages/93/vllm-0.34.0.tar.gz (from https://example/simple/vllm/), version: 0.34.0\n"
    )
    assert own.sdist_url("0.34.0", output) == "https://files.example/packages/93/vllm-0.34.0.tar.gz"
    assert own.sdist_url("0.35.0", output) is None


def test_only_tests_and_pyproject_are_extracted(own: ModuleType, tmp_path: Path) -> None:
    sdist = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("vllm-9.9.9/tests/v1/test_a.py", "vllm-9.9.9/pyproject.toml", "vllm-9.9.9/vllm/__init__.py"):
            info = tarfile.TarInfo(name)
            info.size = 2
            archive.addfile(info, io.BytesIO(b"x\n"))
    root = own.extract_tests(sdist, tmp_path / "src")
    assert root == tmp_path / "src" / "vllm-9.9.9"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        ".complete",
        "pyproject.toml",
        "tests/v1/test_a.py",
    ]


def test_the_model_configs_form_a_hub_cache(own: ModuleType, tmp_path: Path) -> None:
    own.write_model_configs(tmp_path)
    snapshot = tmp_path / "models--facebook--opt-125m" / "snapshots" / own.HUB_REVISION
    assert json.loads((snapshot / "config.json").read_text())["architectures"] == ["OPTForCausalLM"]
    assert (tmp_path / "models--facebook--opt-125m" / "refs" / "main").read_text() == own.HUB_REVISION
