#!/usr/bin/env python3
"""Check every place vllm-kv-cache-limit hooks into vLLM (``compat.HOOKS``,
the attributes of vLLM objects it relies on, ``compat.ATTRIBUTES``, their
run-time resize counterparts, and the vLLM functions vllm-kv-plan calls,
``compat.PLANNER_APIS``) against the installed vLLM and against the source
of another vLLM build.

    scripts/check_hooks.py                       # installed vLLM + newest supported CUDA build
    scripts/check_hooks.py --download 0.33.0     # installed vLLM + the vllm==0.33.0 wheel
    scripts/check_hooks.py --download 0.29.0 --download 0.33.0   # several wheels
    scripts/check_hooks.py --wheel PATH.whl      # installed vLLM + a wheel already on disk
    scripts/check_hooks.py --source DIR          # installed vLLM + a source tree (DIR/vllm/...)
    scripts/check_hooks.py --no-installed ...    # skip the installed vLLM

The CUDA wheel is fetched with ``pip download --no-deps`` into ``.cache/wheels``
and only its ``vllm/**/*.py`` files are extracted (to ``.cache/vllm-src``); it
is never installed, so none of its CUDA dependencies are needed.

Prints one line per checked build and group. Exit status: 0 when every hook
and attribute fits, 1 when one is missing or changed, 3 when the wheel could
not be fetched.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_kv_cache_limit import compat
from vllm_kv_cache_limit.compat import registry

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
DOCS = REPO / "docs" / "compatibility.md"
TABLE_START, TABLE_END = "<!-- hooks-table:start", "<!-- hooks-table:end -->"
ATTRIBUTES_START, ATTRIBUTES_END = "<!-- attributes-table:start", "<!-- attributes-table:end -->"
EXIT_DRIFT = 1
EXIT_FETCH_FAILED = 3
_WHEEL_VERSION = re.compile(r"^vllm-(?P<version>[^-]+)-")


def docs_with_hooks_table(text: str) -> str:
    """``text`` (docs/compatibility.md) with its hooks and attributes tables regenerated."""
    for first, last, table in (
        (TABLE_START, TABLE_END, compat.hooks_table()),
        (ATTRIBUTES_START, ATTRIBUTES_END, compat.attributes_table()),
    ):
        start = text.index("\n", text.index(first)) + 1
        end = text.index(last)
        text = text[:start] + table + text[end:]
    return text


def wheel_version(wheel: Path) -> str:
    """The version in a vLLM wheel's file name."""
    match = _WHEEL_VERSION.match(wheel.name)
    if match is None:
        raise ValueError(f"{wheel.name!r} is not a vllm wheel file name (vllm-VERSION-....whl)")
    return match["version"]


def cached_wheel(version: str | None, wheels: Path) -> Path | None:
    """A vLLM wheel in ``wheels``: of ``version``, or else the newest
    supported one (None when there is none)."""
    from packaging.version import Version

    candidates = []
    for wheel in wheels.glob("vllm-*.whl"):
        found = wheel_version(wheel)
        if (version is None and compat.version_supported(found)) or found == version:
            candidates.append((Version(found), wheel))
    return max(candidates)[1] if candidates else None


def download_wheel(version: str | None, wheels: Path) -> Path:
    """The CUDA vLLM wheel of ``version`` (None: the newest in
    ``compat.SUPPORTED_VLLM``), from ``wheels`` or fetched there with pip."""
    if version is not None and (hit := cached_wheel(version, wheels)) is not None:
        return hit
    requirement = f"vllm=={version}" if version else f"vllm{compat.SUPPORTED_VLLM[0]}"
    wheels.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--python-version",
        "3.11",
        "--dest",
        str(wheels),
        requirement,
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        if version is None and (hit := cached_wheel(None, wheels)) is not None:
            print(f"note: pip download {requirement!r} failed; using the cached {hit.name}")
            return hit
        raise FetchError(
            f"pip download {requirement!r} failed (exit {proc.returncode}); the package "
            f"registry may be unreachable:\n{(proc.stdout + proc.stderr)[-2000:]}"
        )
    saved = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", proc.stdout)
    wheel = Path(saved[-1]) if saved else cached_wheel(version, wheels)
    if wheel is None or not wheel.is_file():
        raise FetchError(f"pip download {requirement!r} left no wheel in {wheels}")
    return wheel


class FetchError(RuntimeError):
    """The wheel could not be fetched."""


def extract_sources(wheel: Path, dest_root: Path) -> Path:
    """Extract only ``vllm/**/*.py`` from ``wheel`` to ``dest_root/<wheel
    name>`` (once) and return that folder, which holds ``vllm/``."""
    dest = dest_root / wheel.stem
    marker = dest / ".complete"
    if marker.exists():
        return dest
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            name = member.filename
            parts = Path(name).parts
            if not (name.startswith("vllm/") and name.endswith(".py")):
                continue
            if Path(name).is_absolute() or ".." in parts:
                raise ValueError(f"unsafe path {name!r} in {wheel.name}")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(member))
    marker.write_text(wheel.name)
    return dest


def source_version(root: Path) -> str:
    """The version written in a source tree's ``vllm/_version.py``."""
    text = root / "vllm" / "_version.py"
    if text.is_file():
        match = re.search(r"""(?:__version__|version)\s*(?::\s*str)?\s*=\s*['"]([^'"]+)['"]""", text.read_text())
        if match:
            return match[1]
    return "unknown"


def report(
    label: str, version: str, problems: list[str], total: int | None = None, what: str = "hooks", skipped: str = ""
) -> bool:
    """Print one line for a checked build; True when every hook fits.
    ``skipped`` names what the check could not cover there, and why."""
    total = len(compat.HOOKS) if total is None else total
    supported = compat.version_supported(version)
    note = "" if supported else f" (outside the supported range {compat.SUPPORTED_VLLM[0]})"
    if problems:
        print(f"FAIL {label} vLLM {version}{note}: {len(problems)} of {total} {what} do not fit{skipped}:")
        for problem in problems:
            print(f"  - {problem}")
        return False
    print(f"OK   {label} vLLM {version}{note}: all {total} {what} fit{skipped}")
    return True


PLANNER = "vllm-kv-plan APIs"
RESIZE = "run-time resize hooks"
ATTRIBUTES = "attributes"
RESIZE_ATTRIBUTES = "run-time resize attributes"
SIM = "vllm-kv-sim APIs"
SIM_ATTRIBUTES = "vllm-kv-sim attributes"


def report_attributes_in_source(root: Path, label: str, version: str | None, shown: str) -> bool:
    """Check ``ATTRIBUTES`` and ``RESIZE_ATTRIBUTES`` in the source tree
    ``root``; the entries a source tree cannot show are named as skipped."""
    ok = True
    for attributes, what in ((compat.ATTRIBUTES, ATTRIBUTES), (compat.RESIZE_ATTRIBUTES, RESIZE_ATTRIBUTES)):
        expected = compat.for_version(attributes, version)
        checked = tuple(a for a in expected if not a.not_in_source)
        unseen = [a.name for a in expected if a.not_in_source]
        skipped = f" ({len(unseen)} more not shown by vLLM's source, left to the installed check: {', '.join(unseen)})"
        problems = compat.check_attributes_in_source(root, checked)
        ok &= report(label, shown, problems, len(checked), what, skipped if unseen else "")
    return ok


def check_wheel(wheel: Path, cache_dir: Path) -> bool:
    """Check the hooks in a wheel's extracted source; True when all fit."""
    root = extract_sources(wheel, cache_dir / "vllm-src")
    version = source_version(root)
    if version == "unknown":
        version = wheel_version(wheel)
    return check_tree(root, f"wheel {wheel.name}", version)


def check_tree(root: Path, label: str, version: str) -> bool:
    """Check the hooks (and planner APIs) that ``version`` should have in
    the source tree ``root``; one line each; True when all fit."""
    known = None if version == "unknown" else version
    hooks, apis = compat.for_version(compat.HOOKS, known), compat.for_version(compat.PLANNER_APIS, known)
    resize = compat.for_version(compat.RESIZE_HOOKS, known)
    ok = report(label, version, compat.check_hooks_in_source(root, hooks), len(hooks))
    ok &= report(label, version, compat.check_hooks_in_source(root, resize), len(resize), RESIZE)
    ok &= report_attributes_in_source(root, label, known, version)
    sim_hooks = compat.for_version(registry.sim_hooks(), known)
    sim_attributes = compat.for_version(registry.sim_attributes(), known)
    ok &= report(label, version, compat.check_hooks_in_source(root, sim_hooks), len(sim_hooks), SIM)
    problems = compat.check_attributes_in_source(root, sim_attributes)
    ok &= report(label, version, problems, len(sim_attributes), SIM_ATTRIBUTES)
    return report(label, version, compat.check_hooks_in_source(root, apis), len(apis), PLANNER) and ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--source", type=Path, metavar="DIR", help="vLLM source tree: the folder that holds vllm/")
    target.add_argument("--wheel", type=Path, metavar="PATH", help="a vLLM wheel file, read without installing it")
    target.add_argument(
        "--download",
        metavar="VERSION",
        nargs="?",
        const="",
        action="append",
        help="fetch the vllm==VERSION CUDA wheel into .cache/wheels (default: the newest "
        "supported); repeat for several versions",
    )
    parser.add_argument("--no-installed", action="store_true", help="do not check the installed vLLM")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="rewrite the hooks and attributes tables in docs/compatibility.md from compat and exit",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=CACHE, help="where wheels and sources are kept (default: .cache)"
    )
    args = parser.parse_args(argv)
    if args.write_docs:
        DOCS.write_text(docs_with_hooks_table(DOCS.read_text()))
        print(f"wrote the hooks and attributes tables in {DOCS}")
        return 0

    ok = True
    if not args.no_installed:
        installed = compat.installed_vllm_version()
        hooks, apis = compat.for_version(compat.HOOKS, installed), compat.for_version(compat.PLANNER_APIS, installed)
        ok &= report("installed", installed, compat.check_hooks(), len(hooks))
        ok &= report("installed", installed, compat.check_hooks(compat.PLANNER_APIS), len(apis), PLANNER)
        resize = compat.for_version(compat.RESIZE_HOOKS, installed)
        ok &= report("installed", installed, compat.check_hooks(compat.RESIZE_HOOKS), len(resize), RESIZE)
        sim = compat.for_version(registry.sim_hooks(), installed)
        ok &= report("installed", installed, compat.check_hooks(registry.sim_hooks()), len(sim), SIM)
        sim_attributes = compat.for_version(registry.sim_attributes(), installed)
        problems = compat.check_attributes(registry.sim_attributes())
        ok &= report("installed", installed, problems, len(sim_attributes), SIM_ATTRIBUTES)
        for attributes, what in ((compat.ATTRIBUTES, ATTRIBUTES), (compat.RESIZE_ATTRIBUTES, RESIZE_ATTRIBUTES)):
            expected = compat.for_version(attributes, installed)
            ok &= report("installed", installed, compat.check_attributes(attributes), len(expected), what)

    if args.source is not None:
        if not (args.source / "vllm").is_dir():
            parser.error(f"--source {str(args.source)!r} holds no vllm/ folder")
        ok &= check_tree(args.source, f"source {args.source}", source_version(args.source))
    elif args.wheel is not None:
        if not args.wheel.is_file():
            parser.error(f"--wheel {str(args.wheel)!r} does not exist")
        ok &= check_wheel(args.wheel, args.cache_dir)
    else:
        for version in args.download or [""]:
            try:
                wheel = download_wheel(version or None, args.cache_dir / "wheels")
            except FetchError as exc:
                print(f"ERROR {exc}", file=sys.stderr)
                return EXIT_FETCH_FAILED
            ok &= check_wheel(wheel, args.cache_dir)
    return 0 if ok else EXIT_DRIFT


if __name__ == "__main__":
    sys.exit(main())
