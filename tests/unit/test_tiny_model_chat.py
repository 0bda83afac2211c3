"""The tiny test model has a chat template, so ``/v1/chat/completions``
works on it as on a real instruct model (vLLM answers 400 without one)."""

from __future__ import annotations

import json
from pathlib import Path

MESSAGES = [{"role": "user", "content": "Hello"}]


def _prompt(model: Path) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def test_the_tiny_model_has_a_chat_template(tiny_model: str) -> None:
    prompt = _prompt(Path(tiny_model))
    assert "Hello" in prompt and prompt.rstrip().endswith("assistant:"), prompt


def test_a_model_built_before_the_template_gets_it(tmp_path: Path) -> None:
    """A model already built (``make model`` before the template existed)
    is given the template by the next build instead of being kept as it is."""
    from tests.tiny_model import build_tiny_model

    out = build_tiny_model(tmp_path / "m")
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    assert build_tiny_model(tmp_path / "m") == out
    assert "Hello" in _prompt(out)
