"""Start a vLLM engine, measure the KV cache its workers allocated, and print
one JSON line. Used by the end-to-end tests and the benchmarks, each engine
in its own process so that nothing outlives the measurement.

    python -m vllm_kv_cache_limit.probe '{"model": "models/tiny-llama", "kv_cache_max_memory": "16M"}'

The JSON object holds ``LLM(...)`` keyword arguments plus optional probe
settings: ``prompts`` (list of str) and ``max_tokens`` for a greedy
generation. The output line starts with ``PROBE_RESULT `` and holds
``kv_cache_bytes`` (per worker, summed over the storages of the KV cache
tensors), ``num_gpu_blocks``, ``block_size``, ``texts`` and, on failure,
``error_type`` and ``error``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_PREFIX = "PROBE_RESULT "


def kv_cache_storages(worker: Any) -> dict[int, tuple[int, str]]:
    """The distinct storages behind a worker's ``model_runner.kv_caches``
    tensors (views of one buffer count once): ``{data_ptr: (bytes, device)}``."""
    import torch

    storages: dict[int, tuple[int, str]] = {}

    def walk(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = (storage.nbytes(), str(item.device))
        elif isinstance(item, (list, tuple)):
            for sub in item:
                walk(sub)
        elif isinstance(item, dict):
            for sub in item.values():
                walk(sub)

    walk(worker.model_runner.kv_caches)
    return storages


def worker_kv_cache_bytes(worker: Any) -> int:
    """Bytes of KV cache a worker holds (for ``LLM.collective_rpc``)."""
    return sum(nbytes for nbytes, _ in kv_cache_storages(worker).values())


class KVCacheProbe:
    """Worker extension for servers under test
    (``--worker-extension-cls vllm_kv_cache_limit.probe.KVCacheProbe``): with
    ``VLLM_SERVER_DEV_MODE=1``, ``POST /collective_rpc {"method":
    "kv_cache_bytes"}`` returns each worker's KV cache bytes."""

    def kv_cache_bytes(self) -> int:
        return worker_kv_cache_bytes(self)

    def rss_bytes(self) -> int:
        return worker_rss_bytes(self)


def worker_rss_bytes(worker: Any) -> int:
    """Resident memory of the worker process."""
    import psutil

    return psutil.Process().memory_info().rss


def engine_cache_settings(llm: Any) -> dict[str, Any]:
    """The KV cache settings an ``LLM`` ended up with, as its engine config
    holds them after start-up."""
    vllm_config = llm.llm_engine.vllm_config
    cache_config = vllm_config.cache_config
    return {
        "num_gpu_blocks": cache_config.num_gpu_blocks,
        "block_size": cache_config.block_size,
        "num_gpu_blocks_override": cache_config.num_gpu_blocks_override,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "kv_cache_max_memory": getattr(cache_config, "kv_cache_max_memory", None),
        "max_model_len": vllm_config.model_config.max_model_len,
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    spec = dict(spec)
    prompts = spec.pop("prompts", ["Hello, my name is"])
    max_tokens = spec.pop("max_tokens", 8)
    result: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**spec)
        result["startup_s"] = time.perf_counter() - started
        result["kv_cache_bytes"] = llm.collective_rpc(worker_kv_cache_bytes)
        result["worker_rss_bytes"] = llm.collective_rpc(worker_rss_bytes)
        result.update(engine_cache_settings(llm))
        if prompts:
            outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            result["texts"] = [o.outputs[0].text for o in outputs]
        result["ok"] = True
    except Exception as exc:  # reported, not raised: the caller reads the line
        result["error_type"] = type(exc).__name__
        result["error"] = str(exc)
        result["error_mro"] = [c.__name__ for c in type(exc).__mro__]
    return result


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """One OpenAI API server started by :func:`api_servers`."""

    base: str
    log_path: Path
    ready_s: float | None = None
    """Seconds from the common launch until /health answered; None if it never did."""
    returncode: int | None = None
    """Exit status when it exited before it was ready."""


@contextlib.contextmanager
def api_servers(
    servers: dict[str, tuple[list[str], dict[str, str]]],
    folder: Path,
    timeout: float = 300.0,
    cwd: Path | None = None,
) -> Iterator[dict[str, Server]]:
    """Start one OpenAI API server per name (its CLI arguments after
    ``--host/--port``, and its environment) at the same instant, wait until
    each answers /health or exits, yield them, then stop them all, process
    groups included. Python's ``requests`` is needed."""
    import requests

    procs: dict[str, tuple[subprocess.Popen, Server]] = {}
    try:
        launched = time.monotonic()
        for name, (args, env) in servers.items():
            port = free_port()
            log_path = folder / f"{name}.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "vllm.entrypoints.openai.api_server",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        *args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            procs[name] = (proc, Server(f"http://127.0.0.1:{port}", log_path))
        pending = set(procs)
        while pending and time.monotonic() < launched + timeout:
            for name in sorted(pending):
                proc, server = procs[name]
                if proc.poll() is not None:
                    server.returncode = proc.returncode
                    pending.discard(name)
                    continue
                try:
                    if requests.get(f"{server.base}/health", timeout=2).status_code == 200:
                        server.ready_s = time.monotonic() - launched
                        pending.discard(name)
                except requests.ConnectionError:
                    pass
            time.sleep(0.5)
        yield {name: server for name, (_, server) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = run(spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
