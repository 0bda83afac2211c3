"""Start one vLLM engine on the GPU with ``LLM(...)``, measure its KV cache
in the worker with ``torch.cuda``, and write the result as JSON.

    python -m tests.gpu.engine_driver SPEC_JSON RESULT_PATH [GO_PATH]   # from the repository's root

With ``GO_PATH`` the engine stays up after writing the result until that file
exists, then generates and writes the result again with ``texts``: the GPU
tests use this to hold two engines on one GPU at the same time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers import engine_cache_settings, enter_engine_process, error_result
from vllm_kv_cache_limit.logic.kv_cache import kv_cache_storages

PROMPTS = ["Hello, my name is", "The capital of France is"]


def worker_cuda_memory(worker: Any) -> dict[str, Any]:
    """Measured in the worker: the KV cache tensors' distinct storages (and
    their devices), the model weights, and torch's allocator on the device."""
    import torch

    storages = kv_cache_storages(worker)
    runner = worker.model_runner
    model = getattr(runner, "model", None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "kv_cache_bytes": sum(nbytes for nbytes, _ in storages.values()),
        "kv_devices": sorted({device for _, device in storages.values()}),
        "weights_bytes": weights,
        "memory_allocated": torch.cuda.memory_allocated(),
        "device": f"cuda:{torch.cuda.current_device()}",
        "free": free,
        "total": total,
        "pid": os.getpid(),
    }


def write(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    go = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    result: dict[str, Any] = {"ok": False, "pid": os.getpid()}
    enter_engine_process()
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(**spec)
        result.update(engine_cache_settings(llm), workers=llm.collective_rpc(worker_cuda_memory), ready=True)
        if go is not None:
            write(out, result)
            while not go.exists():
                time.sleep(0.2)
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        result["texts"] = [o.outputs[0].text for o in outputs]
        result["ok"] = True
    except Exception as exc:  # reported, not raised: the test reads the file
        result.update(error_result(exc))
    write(out, result)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
