"""``vllm-kv-plan``: the arithmetic, the command line and its errors.

The model tests read configurations through vLLM (no engine, no weights
loaded); the tiny models are built once per session under a tmp folder, and
models that only need a config.json get nothing more."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kv_cache_limit import plan as kv_plan
from vllm_kv_cache_limit.plan import (
    NULL_BLOCKS,
    PlanError,
    bytes_per_token,
    capacity,
    least_bytes_for,
    main,
    required_blocks,
    suggest_cap,
)
from vllm_kv_cache_limit.sizes import format_size, parse_size
from vllm_kv_cache_limit.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
CPU_BLOCK = 128  # the CPU backend's block size
BF16 = 2  # bytes; the CPU backend's KV cache dtype for a float32 model

# ---------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------


def test_required_blocks_adds_the_null_block() -> None:
    assert NULL_BLOCKS == 1
    assert required_blocks(4, 1) == 5
    assert required_blocks(4, 3) == 13
    assert required_blocks(9, 2) == 19


@pytest.mark.parametrize("per_request, concurrency", [(0, 1), (4, 0), (-1, 2)])
def test_required_blocks_rejects_impossible_numbers(per_request: int, concurrency: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        required_blocks(per_request, concurrency)


def test_capacity_leaves_out_the_null_block() -> None:
    # 16 MiB of 128 KiB blocks: 128 blocks, 127 usable, 4 blocks per 512 tokens.
    assert capacity(128, 4, 512) == (127, 127 * 128, 31)
    assert capacity(5, 4, 512) == (4, 512, 1)
    assert capacity(1, 4, 512) == (0, 0, 0)
    assert capacity(0, 4, 512) == (0, 0, 0)
    # Gemma 2 style: 12 blocks per 1024-token request across two groups.
    assert capacity(25, 12, 1024) == (24, 2048, 2)


def test_bytes_per_token_is_an_int_when_the_block_divides() -> None:
    assert bytes_per_token(131072, 128) == 1024
    assert isinstance(bytes_per_token(131072, 128), int)
    assert bytes_per_token(1000, 128) == pytest.approx(7.8125)


def _unit_step(text: str) -> Decimal:
    """One step of the last decimal of a format_size result, in bytes."""
    number = text.rstrip("KMGTiB")
    unit = text[len(number) :]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return Decimal(parse_size(f"1{unit}")) / 10 ** max(decimals, 2) if unit != "B" else Decimal(1)


@given(
    block_bytes=st.integers(min_value=1, max_value=2**24),
    per_request=st.integers(min_value=1, max_value=4096),
    concurrency=st.integers(min_value=1, max_value=512),
)
def test_suggested_cap_is_the_smallest_tidy_size_that_fits(
    block_bytes: int, per_request: int, concurrency: int
) -> None:
    needed = required_blocks(per_request, concurrency)
    text, nbytes, blocks = suggest_cap(needed * block_bytes, needed, lambda n: n // block_bytes)
    assert text == format_size(needed * block_bytes, "up")
    assert nbytes == parse_size(text)
    assert blocks == nbytes // block_bytes >= needed
    # One step less in the same unit no longer holds the blocks.
    smaller = Decimal(nbytes) - _unit_step(text)
    assert int(smaller) // block_bytes < needed


def test_suggested_cap_steps_up_when_the_engine_rounds_differently() -> None:
    # An allocator that keeps 100 KiB aside: 640KiB gives 4 blocks, not 5.
    block = 128 * 1024

    def blocks_for(nbytes: int) -> int:
        return max(0, nbytes - 100 * 1024) // block

    text, nbytes, blocks = suggest_cap(5 * block, 5, blocks_for)
    assert (text, blocks) == ("740KiB", 5)
    assert blocks_for(nbytes - int(_unit_step(text)) - 1) == 4


def test_suggested_cap_when_the_engine_gives_more_than_the_arithmetic() -> None:
    # Blocks counted from 10 bytes below the arithmetic's: the least size is smaller.
    text, nbytes, blocks = suggest_cap(5 * 1024, 5, lambda n: (n + 10) // 1024)
    assert least_bytes_for(5, 5 * 1024, lambda n: (n + 10) // 1024) == 5 * 1024 - 10
    assert (text, blocks) == (format_size(5 * 1024 - 10, "up"), 5)


def test_suggested_cap_gives_up_with_a_plan_error() -> None:
    with pytest.raises(PlanError, match="gives 5 KV cache blocks"):
        suggest_cap(5 * 1024, 5, lambda nbytes: 0)


@pytest.mark.parametrize("text, value", [("512", 512), ("32k", 32000), ("32K", 32768), ("1.5k", 1500), ("2M", 2**21)])
def test_token_counts_read_like_vllm(text: str, value: int) -> None:
    args = kv_plan.build_parser().parse_args(["m", "--max-model-len", text])
    assert args.max_model_len == value


# ---------------------------------------------------------------------------
# Errors that need no vLLM: one line on stderr, exit status 2
# ---------------------------------------------------------------------------


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        status = main(argv)
        raise SystemExit(status)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("vllm-kv-plan: error: "), err
    assert "Traceback" not in err
    return err


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
    assert message in _fails(argv, capsys)


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "no-such-model")
    err = _fails([missing], capsys)
    assert f"model folder {missing!r} does not exist" in err


def test_missing_folder_under_an_existing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "models/tiny-lama" is a mistyped folder, not a model id.
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert "model folder 'models/tiny-lama' does not exist" in _fails(["models/tiny-lama"], capsys)


def test_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails([str(tmp_path)], capsys)
    assert "has no config.json" in err


def test_file_instead_of_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    assert "is a file, not a model folder" in _fails([str(path)], capsys)


def test_model_id_not_in_the_cache(capsys: pytest.CaptureFixture[str]) -> None:
    model_id = f"vllm-kv-plan-tests/absent-{uuid.uuid4().hex[:8]}"
    err = _fails([model_id], capsys)
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


# ---------------------------------------------------------------------------
# Models, through vLLM's configuration (no engine)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cpu_vllm() -> None:
    """The expected numbers are those of vLLM's CPU backend."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("expected values are those of vLLM's CPU backend (128-token blocks, bfloat16 KV cache)")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, cpu_vllm: None) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("plan") / "tiny-llama", "llama"))


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory, cpu_vllm: None) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("plan") / "tiny-gemma2", "gemma2"))


@pytest.fixture
def config_only(cpu_vllm: None) -> Any:
    return _config_only


def _config_only(tmp_path: Path, config_class: str, **params: Any) -> str:
    """A model folder holding only a config.json: all the planner reads."""
    import transformers

    getattr(transformers, config_class)(**params).save_pretrained(tmp_path)
    return str(tmp_path)


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    status = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out)


def _llama_bytes_per_token(model: str, tp: int = 1, dtype_bytes: int = BF16) -> int:
    config = json.loads(Path(model, "config.json").read_text())
    kv_heads = max(1, config["num_key_value_heads"] // tp)
    return 2 * config["num_hidden_layers"] * kv_heads * config["head_dim"] * dtype_bytes


def test_llama_forward_answer_matches_the_config(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan([tiny_llama, "--max-model-len", "512", "--concurrency", "3"], capsys)
    per_token = _llama_bytes_per_token(tiny_llama)
    assert per_token == 1024
    assert plan["exact"] is True and plan["estimate"] is None
    assert plan["architecture"] == "LlamaForCausalLM"
    assert plan["block_size"] == CPU_BLOCK
    assert plan["kv_cache_dtype"] == "bfloat16"
    assert plan["bytes_per_token"] == per_token
    assert plan["bytes_per_block"] == per_token * CPU_BLOCK
    assert plan["blocks_per_request"] == math.ceil(512 / CPU_BLOCK)
    assert plan["required_blocks"] == 3 * 4 + 1
    assert plan["required_bytes"] == 13 * per_token * CPU_BLOCK
    assert plan["suggested_kv_cache_max_memory"] == format_size(plan["required_bytes"], "up")
    assert plan["suggested_num_blocks"] == parse_size(plan["suggested_kv_cache_max_memory"]) // plan["bytes_per_block"]
    assert plan["flag"] == f"--kv-cache-max-memory {plan['suggested_kv_cache_max_memory']}"
    assert "num_blocks" not in plan
    assert plan["layers"] == [
        {
            "kind": "full attention",
            "sliding_window": None,
            "num_layers": 2,
            "num_kv_heads": 2,
            "head_size": 64,
            "block_size": CPU_BLOCK,
            "page_bytes": 2 * 2 * 64 * BF16 * CPU_BLOCK,
            "dtype": "bfloat16",
        }
    ]


def test_llama_reverse_answer(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The measured engine: 16M gives 128 blocks of 128 KiB.
    plan = _plan([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", "16M"], capsys)
    assert plan["kv_cache_max_memory"] == "16M"
    assert plan["kv_cache_max_memory_bytes"] == 16 * 2**20
    assert plan["num_blocks"] == 16 * 2**20 // (1024 * CPU_BLOCK) == 128
    assert plan["usable_blocks"] == 127
    assert plan["tokens"] == 127 * CPU_BLOCK
    assert plan["max_concurrency"] == 127 // 4


def test_suggestion_is_the_least_that_holds_the_concurrency(
    tiny_llama: str, capsys: pytest.CaptureFixture[str]
) -> None:
    forward = _plan([tiny_llama, "--max-model-len", "256", "--concurrency", "5"], capsys)
    back = _plan(
        [tiny_llama, "--max-model-len", "256", "--kv-cache-max-memory", forward["suggested_kv_cache_max_memory"]],
        capsys,
    )
    assert back["num_blocks"] == forward["suggested_num_blocks"]
    assert back["max_concurrency"] >= 5
    one_block_less = str(forward["required_bytes"] - 1)
    short = _plan([tiny_llama, "--max-model-len", "256", "--kv-cache-max-memory", one_block_less], capsys)
    assert short["num_blocks"] == forward["required_blocks"] - 1
    assert short["max_concurrency"] == 4


def test_parallelism_dtype_and_block_size(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    tp2 = _plan([tiny_llama, "--max-model-len", "512", "-tp", "2"], capsys)
    assert tp2["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, tp=2) == 512
    assert tp2["tensor_parallel_size"] == 2
    # 2 KV heads over 4 ranks: one replicated head each, as vLLM does.
    tp4 = _plan([tiny_llama, "--max-model-len", "512", "-tp", "4"], capsys)
    assert tp4["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, tp=4) == 512
    pp2 = _plan([tiny_llama, "--max-model-len", "512", "-pp", "2"], capsys)
    assert pp2["bytes_per_token"] == 1024 // 2  # one of the two layers per stage
    fp32 = _plan([tiny_llama, "--max-model-len", "512", "--dtype", "float32", "--block-size", "64"], capsys)
    assert fp32["kv_cache_dtype"] == "float32"
    assert fp32["block_size"] == 64
    assert fp32["bytes_per_token"] == _llama_bytes_per_token(tiny_llama, dtype_bytes=4)
    assert fp32["blocks_per_request"] == 512 // 64


def test_too_small_cap_names_the_minimum(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", "100K"], capsys)
    minimum = 5 * 1024 * CPU_BLOCK
    assert "is too small" in err and f"{minimum} bytes per device" in err
    assert f"--kv-cache-max-memory {format_size(minimum, 'up')}" in err
    plan = _plan([tiny_llama, "--max-model-len", "512", "--kv-cache-max-memory", str(minimum)], capsys)
    assert plan["num_blocks"] == 5 and plan["max_concurrency"] == 1


def test_vllm_rejections_are_one_line(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails([tiny_llama, "--max-model-len", "100000"], capsys)
    assert "User-specified max_model_len (100000) is greater than the derived max_model_len" in err
    err = _fails([tiny_llama, "-tp", "3"], capsys)
    assert "must be divisible by tensor parallel size (3)" in err
    err = _fails([tiny_llama, "--kv-cache-dtype", "int3"], capsys)
    assert "--kv-cache-dtype 'int3' is not one of vLLM's: auto," in err


def test_unknown_architecture(tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads(Path(tiny_llama, "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    err = _fails([str(tmp_path)], capsys)
    assert "Model architectures ['NoSuchForCausalLM'] are not supported" in err
    assert "Supported architectures" not in err
    config["model_type"] = "no_such_model_type"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "model type `no_such_model_type`" in _fails([str(tmp_path)], capsys)


def test_gemma2_sliding_window_layers(tiny_gemma2: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads(Path(tiny_gemma2, "config.json").read_text())
    window = config["sliding_window"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    plan = _plan([tiny_gemma2, "--max-model-len", "1024", "--max-num-batched-tokens", "256"], capsys)
    assert plan["exact"] is True
    kinds = {row["kind"]: row for row in plan["layers"]}
    assert kinds["sliding window"]["sliding_window"] == window
    assert kinds["sliding window"]["num_layers"] == kinds["full attention"]["num_layers"] == 2
    # One block id serves one group (two layers) per block.
    assert plan["bytes_per_block"] == 2 * (2 * 2 * 64 * BF16) * CPU_BLOCK
    full = math.ceil(1024 / CPU_BLOCK)
    # A sliding layer keeps at most window - 1 + in-flight tokens, plus a block.
    assert full < plan["blocks_per_request"] < 2 * full
    longer = _plan([tiny_gemma2, "--max-model-len", "2048", "--max-num-batched-tokens", "256"], capsys)
    assert longer["blocks_per_request"] - plan["blocks_per_request"] == math.ceil(2048 / CPU_BLOCK) - full


def test_architecture_not_mirrored_is_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any
) -> None:
    model = config_only(
        tmp_path,
        "Phi3Config",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=2048,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        architectures=["Phi3ForCausalLM"],
    )
    plan = _plan([model, "--max-model-len", "512"], capsys)
    assert plan["exact"] is False
    assert "Phi3ForCausalLM is planned as plain attention layers" in plan["estimate"]
    assert plan["bytes_per_token"] == 2 * 2 * 2 * 64 * BF16
    main([model, "--max-model-len", "512"])
    out = capsys.readouterr().out
    assert "ESTIMATE: " in out and ": ESTIMATE" in out.splitlines()[0]


def test_mla_is_an_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any) -> None:
    model = config_only(
        tmp_path,
        "DeepseekV3Config",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=2048,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        moe_intermediate_size=128,
        n_group=1,
        topk_group=1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        architectures=["DeepseekV3ForCausalLM"],
    )
    plan = _plan([model, "--max-model-len", "512"], capsys)
    assert plan["exact"] is False and "uses MLA" in plan["estimate"]
    (row,) = plan["layers"]
    assert row["kind"] == "MLA" and row["num_kv_heads"] == 1 and row["head_size"] == 64 + 32
    assert plan["bytes_per_token"] == 2 * (64 + 32) * BF16  # one latent vector per layer


def test_hybrid_and_attention_free_models_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config_only: Any
) -> None:
    jamba = config_only(
        tmp_path / "jamba",
        "JambaConfig",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        architectures=["JambaForCausalLM"],
    )
    assert "JambaForCausalLM mixes attention with Mamba" in _fails([jamba], capsys)
    mamba = config_only(
        tmp_path / "mamba",
        "MambaConfig",
        hidden_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        architectures=["MambaForCausalLM"],
    )
    assert "MambaForCausalLM is attention-free" in _fails([mamba], capsys)


def test_human_table(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([tiny_llama, "--max-model-len", "512", "--concurrency", "2", "--kv-cache-max-memory", "1M"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tiny_llama} (LlamaForCausalLM), vLLM ")
    assert lines[0].endswith(" on cpu: exact")
    rows = [re.match(r"^(\s*\S.*?)\s{2,}(\S.*)$", line) for line in lines[1:]]
    table = {row[1]: row[2] for row in rows if row}
    assert table["KV cache per token"] == "1024 B"
    assert table["blocks needed"] == "9 = 2 x 4 + 1 null block"
    assert table["suggested"] == "--kv-cache-max-memory 1.13MiB  (9 blocks)"
    assert table["  blocks"] == "8 (7 usable + 1 null)"
    assert table["  max concurrency"] == "1 request of 512 tokens"


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
