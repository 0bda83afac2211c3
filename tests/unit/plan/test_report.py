"""The planner's human table."""

from __future__ import annotations

import re

import pytest

from vllm_kv_cache_limit.plan import main


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
