"""The weights' lower bound read from safetensors headers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_kv_cache_limit.logic.weights import weight_bytes_lower_bound


def test_bytes_at_the_load_dtype(tmp_path: Path) -> None:
    save_file(
        {
            "a": torch.zeros(100, 10, dtype=torch.float32),
            "b": torch.zeros(7, dtype=torch.bfloat16),
            "ids": torch.zeros(5, dtype=torch.int64),
        },
        tmp_path / "model.safetensors",
    )
    # float32 loaded as bfloat16 counts 2 bytes an element; integers as stored.
    assert weight_bytes_lower_bound(tmp_path, 2) == 1000 * 2 + 7 * 2 + 5 * 8
    assert weight_bytes_lower_bound(tmp_path, 4) == 1000 * 4 + 7 * 2 + 5 * 8  # never more than stored


def test_sharded_model_counts_the_files_of_its_index(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(10, dtype=torch.float16)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(30, dtype=torch.float16)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"a": torch.zeros(40, dtype=torch.float16)}, tmp_path / "consolidated.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    assert weight_bytes_lower_bound(tmp_path, 2) == 80


def test_without_index_only_one_file_is_surely_loaded(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(40, dtype=torch.float16)}, tmp_path / "model.safetensors")
    save_file({"a": torch.zeros(40, dtype=torch.float16)}, tmp_path / "consolidated.safetensors")
    assert weight_bytes_lower_bound(tmp_path, 2) == 80  # not 160


def test_unreadable_or_missing_weights_count_nothing(tmp_path: Path) -> None:
    assert weight_bytes_lower_bound(tmp_path / "absent", 2) == 0
    assert weight_bytes_lower_bound(tmp_path, 2) == 0
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    assert weight_bytes_lower_bound(tmp_path, 2) == 0


def test_tiny_model_weights(tmp_path: Path) -> None:
    from tests.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "tiny")
    files = list(Path(folder).glob("*.safetensors"))
    assert files
    stored = sum(f.stat().st_size for f in files)
    bound = weight_bytes_lower_bound(folder, 2)
    assert 0 < bound <= stored
