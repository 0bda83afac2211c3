#!/usr/bin/env python3
"""Apply ``upstream/vllm-VERSION.patch`` to vLLM VERSION's Python source (the
CUDA wheel's ``vllm/`` tree, which is the repository's ``vllm/``) in a
temporary folder, with ``patch -p1`` and no fuzz, and compile every file the
patch touches.

    scripts/check_upstream_patch.py              # 0.33.0 and 0.34.0
    scripts/check_upstream_patch.py 0.32.0 0.33.0

The wheel comes from ``.cache/wheels`` or is fetched there as for
``scripts/check_hooks.py`` (never installed). Exit status: 0 when every patch
applies and compiles, 1 otherwise, 3 when a wheel could not be fetched.
"""

from __future__ import annotations

import argparse
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_hooks import CACHE, EXIT_FETCH_FAILED, FetchError, download_wheel, extract_sources  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
UPSTREAM = REPO / "upstream"


def patched_files(patch_text: str) -> list[str]:
    """The paths (``vllm/...``, ``tests/...``) the patch writes."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch_text, flags=re.M)


def apply_patch(patch_file: Path, source: Path, tree: Path) -> subprocess.CompletedProcess[str]:
    """Copy the ``vllm/`` tree of ``source`` into ``tree`` and apply
    ``patch_file`` there with ``patch -p1``, no fuzz, no backups."""
    shutil.copytree(source / "vllm", tree / "vllm")
    return subprocess.run(
        ["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-i", str(patch_file)],
        cwd=tree,
        capture_output=True,
        text=True,
    )


def check(version: str) -> bool:
    patch_file = UPSTREAM / f"vllm-{version}.patch"
    text = patch_file.read_text()
    source = extract_sources(download_wheel(version, CACHE / "wheels"), CACHE / "vllm-src")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        proc = apply_patch(patch_file, source, tree)
        if proc.returncode != 0:
            print(f"vllm {version}: {patch_file.name} does not apply without fuzz:\n{proc.stdout}{proc.stderr}")
            return False
        files = patched_files(text)
        for name in files:
            try:
                py_compile.compile(str(tree / name), doraise=True)
            except py_compile.PyCompileError as exc:
                print(f"vllm {version}: {name} does not compile after the patch: {exc.msg}")
                return False
    offsets = len(re.findall(r"with fuzz|offset", proc.stdout))
    print(
        f"vllm {version}: {patch_file.name} applies (no fuzz, {offsets} hunks at an offset); {len(files)} files compile"
    )
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "versions", nargs="*", default=["0.33.0", "0.34.0"], help="vLLM releases with a patch in upstream/"
    )
    args = parser.parse_args(argv)
    ok = True
    for version in args.versions:
        try:
            ok &= check(version)
        except FetchError as exc:
            print(f"vllm {version}: {exc}")
            return EXIT_FETCH_FAILED
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
