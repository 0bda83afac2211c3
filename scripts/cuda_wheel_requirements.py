#!/usr/bin/env python3
"""Print the requirements of the installed vLLM CUDA wheel that install and
import without a GPU: its ``Requires-Dist`` without extras, less the GPU
kernel packages (``GPU_ONLY``), one per line, markers kept for pip to read.

    .venv-cuda-0.34.0/bin/python scripts/cuda_wheel_requirements.py > reqs.txt

Read from the wheel's own metadata, so the same list serves every release in
the window (0.33.0's and 0.34.0's differ in pins, not in shape). The torch
pin stays: the tier runs the torch the wheel was built against. Standard
library only: it runs in a fresh environment before anything else is in it.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, requires

GPU_ONLY = (
    "flashinfer",
    "tilelang",
    "apache-tvm-ffi",
    "quack-kernels",
    "humming-kernels",
    "tokenspeed-mla",
    "cutlass-dsl",
    "nvidia-cutlass-dsl",
    "pynvvideocodec",
    "nvtx",
    "nvidia-cudnn-frontend",
    "fastsafetensors",
    "instanttensor",
    "torchaudio",
    "torchvision",
    "torchcodec",
)
"""Normalised names (and, for flashinfer, a prefix) of the packages left out:
CUDA kernels and media codecs that need a GPU or a CUDA toolkit to install
or load, some not on the registry at all (flashinfer-python 0.7.3), none
reached by the code the tier runs."""

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""\bextra\s*==""")


def normalised(name: str) -> str:
    """A distribution name as the registry compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_only(name: str) -> bool:
    """Whether a requirement's distribution is one of :data:`GPU_ONLY`."""
    name = normalised(name)
    return name.startswith("flashinfer") or name in GPU_ONLY


def wanted(requirements: list[str]) -> list[str]:
    """``requirements`` (``Requires-Dist`` lines) without extras and GPU-only packages."""
    kept = []
    for line in requirements:
        spec, _, marker = line.partition(";")
        match = _NAME.match(spec)
        if match is None or _EXTRA.search(marker) or gpu_only(match.group(1)):
            continue
        kept.append(line.strip())
    return kept


def main() -> int:
    try:
        listed = requires("vllm")
    except PackageNotFoundError:
        print("the CUDA wheel (distribution vllm) is not installed", file=sys.stderr)
        return 1
    for line in wanted(listed or []):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
