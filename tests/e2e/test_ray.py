"""The cap under vLLM's Ray executor (``distributed_executor_backend="ray"``,
tensor parallel 2 on the CPU backend): each Ray worker holds exactly the cap,
and a cap error raised in one Ray worker reaches the user as the cap error.

Ray is a test dependency only; without it the module is skipped. vLLM's CPU
platform names no Ray resource, so a test-only vLLM plugin
(``fixtures/ray_cpu_plugin``) lets each CPU worker take one logical Ray
"GPU" of the local cluster the driver starts (no GPU is used).

Each test runs a driver process that starts a local Ray cluster
(``ray.init``), runs ``LLM(...)`` in it, shuts the engine and the cluster
down and prints one result line. The cluster lives in the driver because
vLLM's engine core joins the driver's cluster (``RAY_ADDRESS``) and passes the
driver job's runtime environment, which carries the plugin into the Ray
worker processes, to the worker actors. Afterwards no process of the run
(driver, engine core, GCS server, raylet, Ray workers) may be left."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import BASE_ENGINE_ARGS, FIXTURES, engine_env, with_plugins
from tests.e2e.test_startup_failures import RUN_MARKER, run_watched, wait_until_gone

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="ray is not installed (a test dependency only: pip install ray)",
)

RAY_PLUGIN_DIR = FIXTURES / "ray_cpu_plugin"
LOW_MEMORY_PLUGIN_DIR = FIXTURES / "fault_plugin"
MiB = 2**20
BOUND_S = 240
"""Ray start-up plus a tensor-parallel-2 engine takes about a minute on the
2-core test machine."""

DRIVER = textwrap.dedent(
    '''
    """Start a local Ray cluster and LLM(...) on it with the given arguments;
    report the per-worker KV cache bytes and a generation, or the error with
    its chain; shut the engine and the cluster down."""
    import json
    import os
    import shutil
    import sys
    import tempfile
    import time

    if __name__ == "__main__":
        import ray

        spec = json.loads(sys.argv[1])
        result = {"error": None}
        started = time.monotonic()
        # The cluster's session files in a folder of its own, removed at the
        # end (short: Ray's unix socket paths lie below it).
        ray_dir = tempfile.mkdtemp(prefix="kvcl-ray-", dir="/tmp")
        # 4 logical CPUs on a 2-core machine: Ray's CPU count only schedules.
        # Each CPU worker takes one logical "GPU" (see the test plugin).
        context = ray.init(
            num_cpus=4,
            num_gpus=2,
            include_dashboard=False,
            runtime_env={"worker_process_setup_hook": "kvcl_test_ray_cpu.register_ray_worker"},
            _temp_dir=ray_dir,
        )
        # The engine core, a child process, joins this cluster.
        os.environ["RAY_ADDRESS"] = context.address_info["gcs_address"]
        result["ray_start_s"] = time.monotonic() - started
        result["ray_dir"] = ray_dir
        llm = None
        try:
            from vllm import LLM, SamplingParams

            llm = LLM(**spec)
            result["startup_s"] = time.monotonic() - started
            result["kv_cache_bytes"] = llm.collective_rpc("kv_cache_bytes")
            result["kv_cache_max_memory"] = getattr(llm.llm_engine.vllm_config.cache_config, "kv_cache_max_memory", None)
            outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            result["token_ids"] = list(outputs[0].outputs[0].token_ids)
        except Exception as exc:
            result["error"] = {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
            chain, seen = [], {id(exc)}
            cause = exc.__cause__ or exc.__context__
            while cause is not None and id(cause) not in seen:
                seen.add(id(cause))
                chain.append({"type": type(cause).__name__, "message": str(cause)})
                cause = cause.__cause__ or cause.__context__
            result["error"]["chain"] = chain
        finally:
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
            if result["error"] is not None:
                # The workers' error lines, read from their log files: Ray
                # copies them to this process's output only in the background.
                import glob

                logs = sorted(glob.glob(os.path.join(ray_dir, "session_latest", "logs", "worker-*")))
                result["worker_log"] = [
                    line.rstrip()
                    for path in logs
                    for line in open(path, errors="replace")
                    if "KVCacheMaxMemoryError" in line or "found by worker rank" in line
                ]
            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
        result["total_s"] = time.monotonic() - started
        print("DRIVER_RESULT " + json.dumps(result), flush=True)
    '''
)


def run_ray_driver(tiny_model: str, tmp_path: Path, env: dict[str, str], **engine_args: Any) -> tuple[dict, str]:
    """Run DRIVER with tensor parallel 2 on the Ray executor; return its
    result and its log. ``env`` adds environment variables (its
    ``EXTRA_PYTHONPATH``: more plugin folders). Fails unless every process of
    the run (the Ray cluster's included) and the cluster's folder are gone."""
    env = dict(env)
    marker = uuid.uuid4().hex
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    spec = {
        "model": tiny_model,
        **BASE_ENGINE_ARGS,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
        "kv_cache_max_memory": "16M",
        "worker_extension_cls": "tests.helpers.KVCacheProbe",
        **engine_args,
    }
    plugins = [RAY_PLUGIN_DIR, *env.pop("EXTRA_PYTHONPATH", "").split(os.pathsep)]
    run_env = engine_env(
        **env,
        **{
            RUN_MARKER: marker,
            "PYTHONPATH": with_plugins(*plugins),
            # No token file written under the home folder for a throwaway cluster.
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
        },
    )
    run_env.pop("RAY_ADDRESS", None)  # a cluster of its own, never one that exists
    log_path = tmp_path / "driver.log"
    status, seen = run_watched([sys.executable, str(driver), json.dumps(spec)], run_env, log_path)
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if line.startswith("DRIVER_RESULT ")]
    assert lines, f"exit {status}:\n{log[-4000:]}"
    # The Ray cluster was seen running, and nothing of the run is left.
    commands = [what for _, what in seen.values()]
    assert any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands), commands
    marked, alive = wait_until_gone(marker, seen)
    assert marked == [] and alive == [], (marked, alive)
    result = json.loads(lines[-1][len("DRIVER_RESULT ") :])
    assert not Path(result["ray_dir"]).exists(), result["ray_dir"]
    return result, log


def test_each_ray_worker_holds_exactly_the_cap_and_generates(tiny_model: str, tmp_path: Path) -> None:
    # An explicit size would make "exactly the cap" trivial; here vLLM sizes
    # the KV cache from its budget and the cap binds.
    result, log = run_ray_driver(tiny_model, tmp_path, {})
    assert result["error"] is None, (result["error"], log[-4000:])
    assert result["kv_cache_max_memory"] == 16 * MiB
    # Measured in each Ray worker: the storages of its KV cache tensors.
    assert result["kv_cache_bytes"] == [16 * MiB, 16 * MiB], result
    assert len(result["token_ids"]) == 8, result
    assert "RayWorkerProc" in log  # the workers were Ray actors
    assert result["total_s"] < BOUND_S, result


# vLLM 0.32 has two Ray executors: RayExecutorV2 (the default) reports a
# worker's exception to the engine core as a RuntimeError over its message
# queues; the legacy RayDistributedExecutor through ray.get, as Ray's
# RayTaskError wrapping the worker's exception.
EXECUTORS = {
    "ray_v2": ("1", "RuntimeError: Worker failed with error 'The KV cache of 16777216 bytes", "(RayWorkerProc pid="),
    "ray_legacy": ("0", "ray.exceptions.RayTaskError(KVCacheMaxMemoryError)", "(RayWorkerWrapper pid="),
}


# On the same node the engine core reads the cap error from the workers'
# relay, whichever executor reported the failure: the default executor
# covers that path; on another node each executor's report is parsed. The
# other-node runs are ``slow`` (make test-slow): in CI, the parsing of both
# executors' reports is checked by tests/unit/test_policy.py
# (test_cap_error_found_in_the_chain_and_as_ray_cause, the legacy
# executor's RayTaskError; test_cap_error_found_in_the_ray_executor_text_only_when_it_names_the_flag,
# RayExecutorV2's text), and the rest of the path by the same-node run.
@pytest.mark.parametrize(
    ("executor", "worker_node"),
    [
        ("ray_v2", "same-node"),
        pytest.param("ray_v2", "other-node", marks=pytest.mark.slow),
        pytest.param("ray_legacy", "other-node", marks=pytest.mark.slow),
    ],
)
def test_cap_error_in_one_ray_worker_reaches_the_user_as_the_cap_error(
    tiny_model: str, tmp_path: Path, executor: str, worker_node: str
) -> None:
    """Rank 1 alone sees 8 MiB free (test-only low-memory plugin) with an
    explicit 16 MiB KV cache. Both Ray workers raise the cap error (rank 0
    names rank 1); the engine core sees it as vLLM reports a worker failure;
    the user's LLM(...) raises the cap error, chained to vLLM's "Engine core
    initialization failed" RuntimeError. "other-node": the workers' own
    relay writes nothing, as on a node without the first process's folder;
    the engine core finds the cap error in the executor's exception."""
    use_v2, engine_core_sees, worker_actor = EXECUTORS[executor]
    env = {
        "KVCL_TEST_REMOTE_WORKER": "1" if worker_node == "other-node" else "0",
        "EXTRA_PYTHONPATH": str(LOW_MEMORY_PLUGIN_DIR),
        "KVCL_TEST_LOW_MEMORY_RANK": "1",
        "KVCL_TEST_LOW_MEMORY_BYTES": str(8 * MiB),
        "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": use_v2,
    }
    started = time.monotonic()
    result, log = run_ray_driver(tiny_model, tmp_path, env, kv_cache_memory_bytes=16 * MiB)
    took = time.monotonic() - started
    error = result["error"]
    assert error is not None, log[-4000:]
    assert error["type"] == "KVCacheMaxMemoryError" and "ValueError" in error["mro"], (error, log[-4000:])
    assert "The KV cache of 16777216 bytes" in error["message"], error
    assert "free memory of the host memory node" in error["message"] and "8MiB free" in error["message"], error
    assert [c["type"] for c in error["chain"]][:1] == ["RuntimeError"], error
    assert "Engine core initialization failed" in error["chain"][0]["message"], error
    # Raised in both Ray worker actors (rank 0 names rank 1), as their log
    # files say (and, when Ray has relayed them in time, this output) ...
    assert log.count(worker_actor) > 0, log[-4000:]
    workers = "\n".join([log, *result["worker_log"]])
    assert "found by worker rank 1" in workers, (result["worker_log"], log[-4000:])
    assert "KVCacheMaxMemoryError: The KV cache of 16777216 bytes" in workers, (result["worker_log"], log[-4000:])
    # ... and reported to the engine core as vLLM reports a worker failure,
    # which the engine core says once, without a traceback.
    assert engine_core_sees in log, log[-4000:]
    assert "EngineCore failed to start: " in log and "EngineCore encountered" not in log, log[-4000:]
    assert took < BOUND_S, f"start-up took {took:.0f} s to fail"
