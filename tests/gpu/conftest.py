"""GPU end-to-end tests: real vLLM engines on ``cuda:0`` with the tiny model.

They need CUDA and the CUDA build of vLLM; ``scripts/gpu-check.sh`` sets both
up on a GPU machine. Elsewhere they are skipped with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import helpers
from tests.conftest import REPO, TEST_MAX_MODEL_LEN

DRIVER = "tests.gpu.engine_driver"
"""Run with ``python -m`` in the repository's root, where ``tests`` is found."""
ENGINE_TIMEOUT_S = 300

BASE_ENGINE_ARGS: dict[str, Any] = {
    **helpers.BASE_ENGINE_ARGS,
    "max_model_len": TEST_MAX_MODEL_LEN,
    # vLLM's defaults for these depend on the GPU; pinned, every GPU sees
    # the same profiling run and the same minimum block count.
    "max_num_seqs": 16,
    "max_num_batched_tokens": 1024,
}


def _cuda_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (
            f"CUDA is not available (torch {torch.__version__}, "
            f"torch.cuda.is_available() is False); run scripts/gpu-check.sh on a machine "
            f"with an NVIDIA GPU"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if Path(str(i.fspath)).is_relative_to(Path(__file__).parent)]
    if not gpu_items:
        return
    reason = _cuda_reason()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))


def gpu_env(**extra: str) -> dict[str, str]:
    """``helpers.engine_env`` on the first GPU unless CUDA_VISIBLE_DEVICES says otherwise."""
    return helpers.engine_env(**{"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"), **extra})


class Engine:
    """One engine started by ``engine_driver.py`` in its own process."""

    def __init__(
        self, spec: dict[str, Any], folder: Path, name: str, hold: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.result_path = folder / f"{name}.json"
        self.log_path = folder / f"{name}.log"
        self.go_path = folder / f"{name}.go"
        command = [sys.executable, "-m", DRIVER, json.dumps(spec), str(self.result_path)]
        if hold:
            command.append(str(self.go_path))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=gpu_env(**(env or {})), cwd=REPO
            )

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_result(self, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """The first result the driver writes (ready, or failed)."""
        deadline = time.monotonic() + timeout
        while not self.result_path.exists():
            if self.proc.poll() is not None and not self.result_path.exists():
                pytest.fail(f"engine exited {self.proc.returncode} without a result:\n{self.log[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"engine gave no result in {timeout}s:\n{self.log[-4000:]}")
            time.sleep(0.5)
        return json.loads(self.result_path.read_text())

    def finish(self, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """Let a held engine generate, wait for its exit, return its result."""
        self.go_path.touch()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"engine did not finish in {timeout}s:\n{self.log[-4000:]}")
        return json.loads(self.result_path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def start_engine(tiny_model: str, tmp_path: Path):
    """``start_engine(name, hold=False, env=None, **llm_kwargs)``: an engine
    with the tiny model and BASE_ENGINE_ARGS (``env`` adds environment
    variables); killed at the end of the test if still up."""
    engines: list[Engine] = []

    def _start(name: str, hold: bool = False, env: dict[str, str] | None = None, **kwargs: Any) -> Engine:
        engine = Engine({"model": tiny_model, **BASE_ENGINE_ARGS, **kwargs}, tmp_path, name, hold, env)
        engines.append(engine)
        return engine

    yield _start
    for engine in engines:
        engine.kill()
