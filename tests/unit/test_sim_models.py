"""vllm-kv-sim's model shapes: a folder holding only a model's
``config.json`` (no weights, no tokenizer) is enough, and a Hugging Face name
aiconfigurator-core ships a config for becomes such a folder.

Real: vLLM's ``ModelConfig``, ``Scheduler`` and KV cache spec read the
config (vLLM's CPU build); the simulator builds no tokenizer (its tokens are
not the model's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_kv_cache_limit.sim import aiconfigurator  # noqa: E402
from vllm_kv_cache_limit.sim.clock import VirtualClock  # noqa: E402
from vllm_kv_cache_limit.sim.instance import InstanceSpec, SimExecutor, build_engine_core  # noqa: E402
from vllm_kv_cache_limit.sim.step_time import LinearStepTime  # noqa: E402

LINEAR = LinearStepTime(0.01, 0.001, 0.0001)


def _bytes_per_block(config: dict, block_size: int = 16) -> int:
    """K and V of every layer for ``block_size`` tokens, 2 bytes each: vLLM's
    ``dtype="auto"`` serves a float32 checkpoint in 16 bits, bf16 as it is."""
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * 2 * block_size


def test_a_folder_with_only_the_config_is_enough(tiny_model: str, tmp_path: Path) -> None:
    """The tiny Llama's config.json alone (no tokenizer files, which a Llama
    tokenizer cannot be built without here): the engine core is built and its
    blocks have the shape the config gives."""
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", folder / "config.json")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]  # the premise: no tokenizer, no weights
    executor = SimExecutor(VirtualClock(), LINEAR)
    core = build_engine_core(InstanceSpec("a", str(folder), 512), 1 << 24, executor)
    config = json.loads((folder / "config.json").read_text())
    assert executor.bytes_per_block == _bytes_per_block(config)
    assert core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == (1 << 24) // executor.bytes_per_block


def test_a_shipped_config_becomes_a_model_folder(tiny_model: str, tmp_path: Path) -> None:
    """A name with a config in aiconfigurator-core's ``model_configs``
    (``Org--Name_config.json``) becomes a folder with that config.json, under
    the cache folder given; a name without one is None; the folder is reused."""
    shipped = tmp_path / "model_configs"
    shipped.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", shipped / "tiny--Llama-2L_config.json")
    cache = tmp_path / "cache"
    folder = aiconfigurator.model_folder("tiny/Llama-2L", configs=shipped, cache=cache)
    assert folder is not None and Path(folder).parent.parent == cache
    assert (Path(folder) / "config.json").read_bytes() == (shipped / "tiny--Llama-2L_config.json").read_bytes()
    assert aiconfigurator.model_folder("tiny/Llama-2L", configs=shipped, cache=cache) == folder
    assert aiconfigurator.model_folder("tiny/Other", configs=shipped, cache=cache) is None
    executor = SimExecutor(VirtualClock(), LINEAR)
    build_engine_core(InstanceSpec("a", folder, 512), 1 << 24, executor)
    assert executor.bytes_per_block == _bytes_per_block(json.loads((Path(folder) / "config.json").read_text()))


def test_a_planted_link_in_the_cache_is_replaced_not_written_through(tiny_model: str, tmp_path: Path) -> None:
    """A config.json in the cache folder that is a symbolic link to another
    file is replaced by the shipped config; the file it pointed to is untouched."""
    shipped = tmp_path / "model_configs"
    shipped.mkdir()
    shutil.copy(Path(tiny_model) / "config.json", shipped / "tiny--Llama-2L_config.json")
    cache = tmp_path / "cache"
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    planted = cache / "models" / "tiny--Llama-2L" / "config.json"
    planted.parent.mkdir(parents=True)
    planted.symlink_to(target)
    folder = aiconfigurator.model_folder("tiny/Llama-2L", configs=shipped, cache=cache)
    assert folder is not None and not planted.is_symlink()
    assert planted.read_bytes() == (shipped / "tiny--Llama-2L_config.json").read_bytes()
    assert target.read_text() == "{}"


@pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core is not installed (make sim)")
def test_qwen3_8b_from_aiconfigurator_core(tmp_path: Path) -> None:
    """Qwen/Qwen3-8B's shipped config: 36 layers, 8 KV heads of 128, bf16: 144 KiB a token, 2.25 MiB a block of 16."""
    folder = aiconfigurator.model_folder("Qwen/Qwen3-8B", cache=tmp_path)
    assert folder is not None
    executor = SimExecutor(VirtualClock(), LINEAR)
    build_engine_core(InstanceSpec("q", folder, 4096), 1 << 30, executor)
    assert executor.bytes_per_block == 36 * 2 * 8 * 128 * 2 * 16
