"""`from vllm import LLM; LLM(model, kv_cache_max_memory=...)` in a plain
script that never imports this package: the start-up hook makes it work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import engine_env
from tests.e2e.test_cap import info_line

SCRIPT = """
import sys

def kv_bytes(worker):
    import torch
    storages = {}
    def walk(x):
        if isinstance(x, torch.Tensor):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x: walk(y)
        elif isinstance(x, dict):
            for y in x.values(): walk(y)
    walk(worker.model_runner.kv_caches)
    return sum(storages.values())

if __name__ == "__main__":
    import json
    from vllm import LLM, SamplingParams
    llm = LLM(sys.argv[1], kv_cache_max_memory="16M", max_model_len=512,
              gpu_memory_utilization=0.25, enforce_eager=True, seed=0)
    print("KV_BYTES", llm.collective_rpc(kv_bytes)[0])
    cache = llm.llm_engine.vllm_config.cache_config
    text = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    print("ENGINE " + json.dumps({"num_gpu_blocks": cache.num_gpu_blocks,
                                  "kv_cache_max_memory": cache.kv_cache_max_memory, "text": text}))
"""


def run_script(tiny_model: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model],
        # cwd "/": the package is found in site-packages only, as for a user.
        capture_output=True,
        text=True,
        timeout=300,
        env=engine_env(**env),
        cwd="/",
    )


@pytest.mark.smoke
def test_llm_keyword_works_without_importing_the_plugin(tiny_model: str) -> None:
    """Also the cap of 16M on an engine sized by vLLM's own budget: the KV
    cache is the whole blocks within the cap (here exactly the cap), as the
    worker measures it and the INFO line says, and the engine generates."""
    proc = run_script(tiny_model)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kv = [line for line in proc.stdout.splitlines() if line.startswith("KV_BYTES")]
    cap = 16 * 2**20
    assert kv == [f"KV_BYTES {cap}"]
    (engine,) = [json.loads(line[len("ENGINE ") :]) for line in proc.stdout.splitlines() if line.startswith("ENGINE ")]
    assert engine["kv_cache_max_memory"] == cap
    assert cap % engine["num_gpu_blocks"] == 0  # whole blocks: cap - allocated < one block
    assert engine["text"]
    line = info_line(proc.stdout + proc.stderr)
    assert int(line["cap"]) == cap and line["bound"] == "bound"
    assert int(line["blocks"]) == engine["num_gpu_blocks"]
    assert int(line["budget"]) > cap


def test_excluded_plugin_leaves_vllm_as_without_it(tiny_model: str) -> None:
    # With VLLM_PLUGINS naming other plugins only, vLLM does not know the keyword.
    proc = run_script(tiny_model, VLLM_PLUGINS="some_other_plugin")
    assert proc.returncode != 0
    assert "unexpected keyword argument 'kv_cache_max_memory'" in proc.stderr


TWO_ENGINES = """
import gc, sys

from vllm_kv_cache_limit.logic.kv_cache import worker_kv_cache_bytes

if __name__ == "__main__":
    from vllm import LLM
    for attempt in range(2):
        # The second engine also sees what the first one left in this
        # process's environment (the plugin's internal values).
        llm = LLM(sys.argv[1], max_model_len=512, gpu_memory_utilization=0.25, enforce_eager=True,
                  fail_on_environ_validation=True)
        print("KV_BYTES", llm.collective_rpc(worker_kv_cache_bytes)[0], flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
"""


@pytest.mark.smoke
@pytest.mark.plugin_only  # the plugin's environment variables
def test_documented_variables_pass_vllms_environment_validation(tiny_model: str, tmp_path) -> None:
    """vLLM checks every VLLM_* variable against its own table and, with
    fail_on_environ_validation, refuses unknown ones: the plugin's documented
    variables (and what it sets itself) must pass, twice in one process, and
    the cap from the environment must hold exactly."""
    from vllm.engine.arg_utils import EngineArgs

    if "fail_on_environ_validation" not in EngineArgs.__dataclass_fields__:
        pytest.skip("this vLLM has no fail_on_environ_validation")
    env = {
        "VLLM_KV_CACHE_MAX_MEMORY": "16M",
        "VLLM_KV_CACHE_LIMIT_STARTUP_LOCK": "1",
        "VLLM_KV_CACHE_LIMIT_LOCK_DIR": str(tmp_path / "locks"),
        "VLLM_KV_CACHE_LIMIT_LOCK_TIMEOUT": "600",
    }
    proc = subprocess.run(
        [sys.executable, "-c", TWO_ENGINES, tiny_model],
        capture_output=True,
        text=True,
        timeout=600,
        env=engine_env(**env),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    kv = [line for line in proc.stdout.splitlines() if line.startswith("KV_BYTES")]
    assert kv == [f"KV_BYTES {16 * 2**20}"] * 2, output[-4000:]
    assert "Unknown vLLM environment variable" not in output, output[-4000:]
