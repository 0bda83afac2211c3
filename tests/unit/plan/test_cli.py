"""``vllm-kv-plan``'s command line: numbers read like vLLM's, errors that
need no vLLM in one line with exit status 2, and the module run as a script."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.unit.plan.conftest import fails
from vllm_kv_cache_limit.plan import build_parser


@pytest.mark.parametrize("text, value", [("512", 512), ("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("2M", 2**21)])
def test_token_counts_read_like_vllm(text: str, value: int) -> None:
    args = build_parser().parse_args(["m", "--max-model-len", text])
    assert args.max_model_len == value


@pytest.mark.parametrize(
    "argv, message",
    [
        (["m", "--concurrency", "0"], "--concurrency must be at least 1, got '0'"),
        (["m", "--max-model-len", "-5"], "--max-model-len must be a whole number"),
        (["m", "--max-model-len", "long"], "--max-model-len must be a whole number such as 8, 4096 or 32k, got 'long'"),
        (["m", "-tp", "0"], "--tensor-parallel-size must be at least 1"),
        (["m", "--block-size", "1.5"], "--block-size must be a whole number"),
        (["m", "--kv-cache-max-memory", "lots"], "Invalid size 'lots'"),
        (["m", "--kv-cache-max-memory", "0"], "at least one byte"),
        (["m", "--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_numbers_fail_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in fails(argv, capsys)


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-model")
    err = fails([missing], capsys)
    assert f"model folder {missing!r} does not exist" in err


def test_missing_folder_under_an_existing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "models/tiny-lama" is a mistyped folder, not a model id.
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert "model folder 'models/tiny-lama' does not exist" in fails(["models/tiny-lama"], capsys)


def test_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fails([str(tmp_path)], capsys)
    assert "has no config.json" in err


def test_file_instead_of_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert "is a file, not a model folder" in fails([str(path)], capsys)


def test_model_id_not_in_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    model_id = f"vllm-kv-plan-tests/absent-{uuid.uuid4().hex[:8]}"
    err = fails([model_id], capsys)
    assert f"model {model_id!r} is neither a local folder nor in the local Hugging Face cache" in err


def test_error_from_a_subprocess_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kv_cache_limit.plan", str(tmp_path / "absent")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"vllm-kv-plan: error: model folder {str(tmp_path / 'absent')!r} does not exist"
    ]


def test_console_script_in_a_subprocess(tiny_llama: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_kv_cache_limit.plan",
            tiny_llama,
            "--max-model-len",
            "512",
            "--kv-cache-max-memory",
            "16M",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)  # stdout holds the object and nothing else
    for key in (
        "bytes_per_token",
        "bytes_per_block",
        "block_size",
        "required_bytes",
        "suggested_kv_cache_max_memory",
        "num_blocks",
        "tokens",
        "max_concurrency",
    ):
        assert key in plan
    assert (plan["bytes_per_token"], plan["num_blocks"], plan["max_concurrency"]) == (1024, 128, 31)
