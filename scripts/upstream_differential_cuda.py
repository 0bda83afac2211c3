#!/usr/bin/env python3
"""The differential check of ``upstream/vllm-0.34.0.patch`` on vLLM's CUDA
wheel without a GPU: the same engine arguments on the same faked device
through the plugin (``.venv-cuda-0.34.0``) and through vLLM patched without
the plugin (``.venv-upstream-cuda-0.34.0``, ``make test-upstream-cuda``
builds it). Prints a Markdown table (``upstream/README.md`` holds the last one).

    .venv/bin/python scripts/upstream_differential_cuda.py
    scripts/upstream_differential_cuda.py --plugin-python P --upstream-python Q

Each case runs vLLM's own code from the engine arguments to the final block
count: ``create_engine_config``; the GPU worker's start-up gate
(``request_memory``) and its ``determine_available_memory`` (vLLM's memory
profiling over torch's readings); the engine core's ``get_kv_cache_configs``;
with the extensible KV cache, ``finalize_extensible_kv_cache`` with the block
count the workers measured after warmup. Only the device is faked: torch's
CUDA readings, NVML and the platform (``tests/cuda_wheel/conftest.py``); no
model runs, so the model runner is what its profiling run does to the device
(weights loaded, an activation peak) and warmup's measurement is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "cuda_wheel" / "conftest.py"
VERSION = "0.34.0"
PLUGIN = REPO / f".venv-cuda-{VERSION}" / "bin" / "python"
PATCHED = REPO / f".venv-upstream-cuda-{VERSION}" / "bin" / "python"
MODEL = REPO / "models" / "tiny-llama"
MiB, GiB = 1 << 20, 1 << 30
WEIGHTS, ACTIVATION_PEAK = 2 * GiB, 1 * GiB
MAX_MODEL_LEN = 512

# (engine arguments, free memory at start-up, KV cache bytes the workers
# measure after warmup with the extensible KV cache).
CASES: list[tuple[dict[str, Any], int, int | None]] = [
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "16M"}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "1G"}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": 16 * MiB + 12345}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "75G"}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "8G"}, 20 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "18G"}, 20 * GiB, None),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "64M"}, 80 * GiB, 1 * GiB),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "64M"}, 80 * GiB, 32 * MiB),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "60G"}, 80 * GiB, 1 * GiB),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "8G"}, 20 * GiB, 4 * GiB),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "8G"}, 20 * GiB, 12 * GiB),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "18G"}, 20 * GiB, 12 * GiB),
    ({"enable_extensible_kv_cache": True}, 80 * GiB, 1 * GiB),
    ({"kv_cache_max_memory": "16M", "kv_cache_memory_bytes": 64 * MiB}, 80 * GiB, None),
    ({"kv_cache_max_memory": "32M", "kv_cache_memory_bytes": 16 * MiB}, 80 * GiB, None),
    ({"kv_cache_max_memory": "16M", "num_gpu_blocks_override": 1000}, 80 * GiB, None),
    ({"kv_cache_max_memory": "16M", "num_gpu_blocks_override": 64}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": False, "kv_cache_max_memory": "300K"}, 80 * GiB, None),
    ({"enable_extensible_kv_cache": True, "kv_cache_max_memory": "300K"}, 80 * GiB, 1 * GiB),
    ({"kv_cache_max_memory": "100T"}, 80 * GiB, None),
]


def _load_fakes() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("kv_cache_limit_cuda_wheel_fakes", FAKES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _ProfiledRunner:
    """The model runner as ``determine_available_memory`` uses it: the
    weights' size, and a profiling run that peaks above them on the device."""

    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu
        self.model_memory_usage = WEIGHTS

    def profile_run(self, randomize_inputs: bool = False) -> None:
        self.gpu.allocate(0, peak=ACTIVATION_PEAK)

    def profile_cudagraph_memory(self) -> int:
        return 0


def _outcome(exc: Exception) -> str:
    message = str(exc)
    if "--kv-cache-max-memory" not in message:
        return f"error: {type(exc).__name__}: {message[:80]}"
    for words, short in (
        ("too small", "too small"),
        ("larger than the total memory", "larger than the total memory"),
        ("can still give this instance", "above what the device can still give"),
        ("larger than the free memory", "above the free memory"),
    ):
        if words in message:
            return f"error naming the cap ({short})"
    return f"error naming the cap: {message[:80]}"


def _run_case(fakes: types.ModuleType, model: str, args: dict[str, Any], free: int, measured: int | None) -> str:
    import pytest
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.engine import core as engine_core
    from vllm.v1.worker import gpu_worker  # noqa: F401  before the fake: its import asks vLLM's kernels about fp8 on CUDA
    from vllm.v1.worker.worker_base import CompilationTimes

    monkeypatch = pytest.MonkeyPatch()
    try:
        gpu = fakes.install_fake_cuda(monkeypatch)
        gpu.free = free
        monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
        config = EngineArgs(model=model, max_model_len=MAX_MODEL_LEN, **args).create_engine_config()
        # The GPU worker after init_device and load_model (no process group, no device).
        worker = fakes.bare_gpu_worker(config)
        gpu.allocate(WEIGHTS)
        worker.model_runner = _ProfiledRunner(gpu)
        budget = worker.determine_available_memory()
        # The engine core: the plan, then with the extensible KV cache its final size.
        spec, specs, groups = fakes.attention_specs(config)
        layers = len(specs[0])
        configs = engine_core.get_kv_cache_configs(config, specs, [budget], groups)
        scheduler_config = generate_scheduler_kv_cache_config(configs)
        block_bytes = spec.page_size_bytes * layers
        extensible = bool(config.cache_config.enable_extensible_kv_cache)
        if extensible:
            assert measured is not None, "an extensible case needs the measured size"
            times = [CompilationTimes(0.0, 0.0, num_kv_blocks=measured // block_bytes)]
            num_blocks = engine_core.finalize_extensible_kv_cache(config, configs, scheduler_config, times)
        else:
            num_blocks = scheduler_config.num_blocks
        allocated = max(t.size for t in configs[0].kv_cache_tensors) * len(configs[0].kv_cache_tensors)
        assert allocated == num_blocks * block_bytes, (allocated, num_blocks, block_bytes)
        committed = _committed_by_plugin()
        if committed is not None:
            # The plugin's block pool keeps the cap's reservation and the
            # engine starts at a run-time limit: compare what is committed.
            num_blocks, allocated = committed, committed * block_bytes
        return f"{num_blocks} blocks, {allocated} bytes" + (" (extensible)" if extensible else "")
    except Exception as exc:  # the outcome compared, whatever it is
        return _outcome(exc)
    finally:
        monkeypatch.undo()


def _committed_by_plugin() -> int | None:
    """The blocks the plugin's engine core starts at when its block pool
    covers more (vLLM 0.34's extensible cache under a cap); None otherwise,
    and without the plugin (the patched side)."""
    try:
        from vllm_kv_cache_limit.hooks.cap import engine_core as cap_engine_core
    except ImportError:
        return None
    committed = getattr(cap_engine_core._active, "committed", None)
    cap_engine_core._active.committed = None
    return committed


def child(model: str) -> None:
    """Run every case in this interpreter; one JSON list on stdout's last line."""
    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    import vllm.model_executor.model_loader  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    from vllm.config import cache

    fakes = _load_fakes()
    results = [_run_case(fakes, model, args, free, measured) for args, free, measured in CASES]
    plugin = "vllm_kv_cache_limit" in sys.modules
    native = "kv_cache_max_memory" in Path(cache.__file__).read_text()  # vLLM's own source
    print(json.dumps({"results": results, "plugin": plugin, "native_field": native}))


def _run(python: Path, model: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(python.absolute()), str(Path(__file__).resolve()), "--child", "--model", str(Path(model).absolute())],
        capture_output=True,
        text=True,
        cwd="/",
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    if proc.returncode != 0:
        sys.exit(f"{python} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _describe(args: dict[str, Any], free: int, measured: int | None) -> str:
    words = [f"`{k}={v!r}`" for k, v in args.items() if k != "enable_extensible_kv_cache"]
    extensible = args.get("enable_extensible_kv_cache")
    mode = {True: "on", False: "off", None: "unset"}[extensible]
    after = f"; warmup measures {measured // MiB} MiB" if measured is not None and extensible is not False else ""
    return f"{', '.join(words) or 'no cap'} (extensible {mode}; {free // GiB} GiB free{after})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin-python", type=Path, default=PLUGIN)
    parser.add_argument("--upstream-python", type=Path, default=PATCHED)
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.model)
        return 0
    plugin, patched = _run(args.plugin_python, args.model), _run(args.upstream_python, args.model)
    if not plugin["plugin"] or plugin["native_field"]:
        sys.exit(f"{args.plugin_python}: expected vLLM unpatched with the plugin active")
    if patched["plugin"] or not patched["native_field"]:
        sys.exit(f"{args.upstream_python}: expected vLLM patched, without the plugin")
    print(
        f"| engine arguments (max_model_len={MAX_MODEL_LEN}; device 80 GiB; weights 2 GiB, "
        "activation peak 1 GiB) | plugin | patched vLLM | same |"
    )
    print("| --- | --- | --- | --- |")
    same = broken = 0
    for (case_args, free, measured), a, b in zip(CASES, plugin["results"], patched["results"], strict=True):
        same += a == b
        broken += a.startswith("error: ") or b.startswith("error: ")  # failed, and not on the cap
        print(f"| {_describe(case_args, free, measured)} | {a} | {b} | {'yes' if a == b else '**no**'} |")
    print(f"\n{same} of {len(CASES)} cases the same.")
    if broken:
        print(f"{broken} case(s) failed for a reason other than the cap: the comparison itself is broken.")
    return 0 if same == len(CASES) and not broken else 1


if __name__ == "__main__":
    sys.exit(main())
