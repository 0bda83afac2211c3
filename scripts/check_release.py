#!/usr/bin/env python3
"""The checks for the day vLLM ships a release (``make check-release
VLLM_VERSION=X``), one after the other, each run even when one before failed:

1. hooks and attributes against the release's source (``scripts/check_hooks.py
   --no-installed --download X``);
2. the CUDA-wheel tier (``make test-cuda-wheel VLLM_VERSION=X``);
3. vLLM's own unit tests of the hooked code, the same outcome test by test
   with the plugin installed and unused as with ``VLLM_PLUGINS=""``
   (``scripts/vllm_own_tests.py X``);
4. the upstream patch: ``upstream/vllm-X.patch`` when there is one, else the
   newest one of an earlier release, applied to X's source without fuzz and
   its files compiled.

    scripts/check_release.py 0.34.0

Ends with a table (step, result, seconds, detail). Exit status: 0 when every
step passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import py_compile
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_hooks import CACHE, FetchError, download_wheel, extract_sources  # noqa: E402
from check_upstream_patch import UPSTREAM, apply_patch, patched_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
_PATCH_VERSION = re.compile(r"^vllm-(?P<version>.+)\.patch$")
_PYTEST_SUMMARY = re.compile(r"^=+ (?P<summary>.*\d+ (?:passed|failed|error|errors|skipped|deselected).*?) =+$")


@dataclass
class Step:
    """One check: ``run`` returns whether it passed and a one-line detail."""

    name: str
    run: Callable[[], tuple[bool, str]]


@dataclass
class Result:
    name: str
    ok: bool
    seconds: float
    detail: str


def run_steps(steps: Sequence[Step], clock: Callable[[], float] = time.monotonic) -> list[Result]:
    """Run every step, whatever the ones before did; an exception fails its step."""
    results = []
    for step in steps:
        print(f"\n== {step.name} ==", flush=True)
        start = clock()
        try:
            ok, detail = step.run()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append(Result(step.name, ok, clock() - start, detail))
    return results


def table(results: Sequence[Result]) -> str:
    """The results as a plain-text table."""
    rows = [("step", "result", "seconds", "detail")]
    rows += [(r.name, "ok" if r.ok else "FAIL", f"{r.seconds:.0f}", r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for name, result, seconds, detail in rows:
        lines.append(f"{name:<{widths[0]}}  {result:<{widths[1]}}  {seconds:>{widths[2]}}  {detail}".rstrip())
    return "\n".join(lines)


def exit_status(results: Sequence[Result]) -> int:
    return 0 if all(r.ok for r in results) else 1


def run_command(command: Sequence[str]) -> tuple[int, list[str]]:
    """Run ``command`` in the repository, its output shown as it comes and kept."""
    lines = []
    with subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
    return proc.returncode, lines


def last_line(lines: Sequence[str]) -> str:
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def hooks_detail(returncode: int, lines: Sequence[str]) -> str:
    """``check_hooks.py``'s lines in one: the groups that fit, the ones that do not."""
    fits = [line for line in lines if line.startswith("OK ")]
    misfits = [line for line in lines if line.startswith("FAIL ")]
    if returncode == 3:
        return "the wheel could not be fetched"
    if misfits:
        what = "; ".join(re.sub(r"^FAIL .*?: ", "", line).rstrip(":") for line in misfits)
        return f"{len(misfits)} of {len(fits) + len(misfits)} groups do not fit: {what}"
    return f"all {len(fits)} groups fit (hooks, resize hooks, attributes, planner APIs)"


def pytest_detail(returncode: int, lines: Sequence[str]) -> str:
    """pytest's closing summary (``30 passed in 61.2s``), else the last line."""
    for line in reversed(lines):
        if match := _PYTEST_SUMMARY.match(line.strip()):
            return match["summary"]
    return last_line(lines) or f"exit {returncode}"


def command_step(
    name: str, command: Sequence[str], detail: Callable[[int, Sequence[str]], str] = lambda rc, lines: last_line(lines)
) -> Step:
    """A step that runs ``command``: passed when it exits 0."""

    def run() -> tuple[bool, str]:
        returncode, lines = run_command(command)
        return returncode == 0, detail(returncode, lines)

    return Step(name, run)


def patch_for(version: str, upstream: Path = UPSTREAM) -> Path | None:
    """``upstream/vllm-VERSION.patch``, else the newest patch of an earlier release."""
    from packaging.version import InvalidVersion, Version

    target = Version(version)
    candidates = []
    for path in upstream.glob("vllm-*.patch"):
        match = _PATCH_VERSION.match(path.name)
        try:
            found = Version(match["version"]) if match else None
        except InvalidVersion:
            found = None
        if found is not None and found <= target:
            candidates.append((found, path))
    return max(candidates)[1] if candidates else None


def patch_result(version: str, patch_file: Path, source: Path) -> tuple[bool, str]:
    """Whether ``patch_file`` applies to the ``vllm/`` tree in ``source``
    without fuzz and every file it writes compiles."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        proc = apply_patch(patch_file, source, tree)
        output = proc.stdout + proc.stderr
        print(output, end="")
        if proc.returncode != 0:
            failed = re.findall(
                r"^(\d+) out of (\d+) hunks? FAILED -- saving rejects to file (\S+?)\.rej", output, re.M
            )
            if not failed:
                return False, f"{patch_file.name} does not apply to {version}: {last_line(output.splitlines())}"
            hunks = sum(int(bad) for bad, _, _ in failed)
            where = ", ".join(f"{name} {bad}/{total}" for bad, total, name in failed)
            return False, (
                f"{patch_file.name} does not apply to {version} without fuzz: "
                f"{hunks} hunks fail in {len(failed)} files ({where})"
            )
        files = patched_files(patch_file.read_text())
        for name in files:
            try:
                py_compile.compile(str(tree / name), doraise=True)
            except py_compile.PyCompileError as exc:
                return False, f"{patch_file.name} on {version}: {name} does not compile: {exc.msg}"
    offsets = len(re.findall(r"with fuzz|offset", output))
    return (
        True,
        f"{patch_file.name} applies to {version} (no fuzz, {offsets} hunks at an offset); {len(files)} files compile",
    )


def upstream_step(version: str) -> Step:
    def run() -> tuple[bool, str]:
        patch_file = patch_for(version)
        if patch_file is None:
            return False, f"no upstream/vllm-*.patch of {version} or an earlier release"
        try:
            source = extract_sources(download_wheel(version, CACHE / "wheels"), CACHE / "vllm-src")
        except FetchError as exc:
            return False, f"the wheel could not be fetched: {str(exc).splitlines()[0]}"
        return patch_result(version, patch_file, source)

    return Step("upstream patch", run)


def steps(version: str) -> list[Step]:
    """The four checks of release ``version``."""
    python = sys.executable
    return [
        command_step(
            "hooks and attributes",
            [python, str(SCRIPTS / "check_hooks.py"), "--no-installed", "--download", version],
            hooks_detail,
        ),
        command_step(
            "CUDA-wheel tier",
            ["make", "--no-print-directory", "test-cuda-wheel", f"VLLM_VERSION={version}"],
            pytest_detail,
        ),
        command_step("vLLM's own tests, plugin unused", [python, str(SCRIPTS / "vllm_own_tests.py"), version]),
        upstream_step(version),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    args = parser.parse_args(argv)
    results = run_steps(steps(args.version))
    print(f"\nvLLM {args.version}: {sum(r.ok for r in results)} of {len(results)} checks passed")
    print(table(results))
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
