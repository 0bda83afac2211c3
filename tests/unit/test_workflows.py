"""The GitHub workflows cannot run here: they are validated against the
GitHub workflow schema that check-jsonschema ships, and checked to run what
the project runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def check(paths: list[Path]) -> subprocess.CompletedProcess:
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or "check-jsonschema"
    return subprocess.run(
        [exe, "--builtin-schema", "vendor.github-workflows", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_workflows_are_valid() -> None:
    assert [p.name for p in WORKFLOWS] == ["ci.yml", "gpu.yml"]
    result = check(WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_invalid_workflow_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOWS[0].read_text().replace("runs-on:", "run-on:"))
    result = check([broken])
    assert result.returncode != 0, result.stdout


@pytest.mark.parametrize(("name", "command"), [("ci.yml", "bash .ci/run"), ("gpu.yml", "bash scripts/gpu-check.sh")])
def test_workflow_runs_the_project_command(name: str, command: str) -> None:
    text = (REPO / ".github" / "workflows" / name).read_text()
    assert f"run: {command}" in text


def test_gpu_workflow_targets_a_gpu_runner_and_keeps_the_log() -> None:
    text = (REPO / ".github" / "workflows" / "gpu.yml").read_text()
    assert "runs-on: [self-hosted, gpu]" in text
    assert "workflow_dispatch" in text and "schedule" in text
    assert "upload-artifact" in text and ".cache/gpu-venv.log" in text
