"""Build tiny random-weight models on the spot, with no network.

The demo (``make serve``) and the end-to-end tests use a 2-layer Llama:
hidden size 256, 4 attention heads, 2 KV heads (head_dim 64; vLLM's CPU
attention backend rejects head_dim 16), float32, seeded random weights, and a
small byte-level BPE tokenizer trained here on a built-in text. Other
architectures (Qwen2, Qwen3, Mistral, Gemma 2) come in the same size for the
planner's tests. A larger size, ``medium``, is for benchmarks whose numbers
depend on batching (see ``SIZES``). Not part of the package; from the
repository's root:

    python -m tests.tiny_model OUT_DIR [--arch llama] [--size tiny|medium]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "SIZES", "build_tiny_model"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A key-value cache keeps the keys
and values of past tokens so that each new token attends to them without
recomputing them. vLLM stores that cache in fixed-size blocks and hands them
out to requests as they grow. Memory is finite: a cap on the cache leaves room
for other models on the same device. Hello, world! Once upon a time there was
a small language model that answered every question with random words.
0 1 2 3 4 5 6 7 8 9 10 100 1000 Monday Tuesday Wednesday Thursday Friday.
"""

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}

ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (transformers config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 128,
            "query_pre_attn_scalar": 64,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            # vLLM's Gemma2ForCausalLM always ties lm_head to the embeddings
            # and has no lm_head weight to load.
            "tie_word_embeddings": True,
        },
    ),
    # Mixture of experts: vLLM keeps its data-parallel ranks coupled.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # About 100M parameters (8 layers, hidden size 1024; 8 KiB of KV cache a
    # token in bfloat16). Reading its weights takes most of a decode step on
    # the CPU, as on a GPU, so tokens/s grows with the batch (1.7x from 8 to
    # 16 sequences on 2 cores), where the tiny one's step is mostly overhead.
    "medium": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
}

SEED = 1234
VOCAB_SIZE = 512


def _train_tokenizer(out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=_COMMON["max_position_embeddings"],
    )
    fast.save_pretrained(out)
    return fast


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A plain chat template, so that ``/v1/chat/completions`` works on the tiny
model (vLLM refuses chat without one); the answer is gibberish all the same."""


def _ensure_chat_template(out: Path) -> None:
    """Give the tokenizer in ``out`` the chat template where it has none
    (also a model built before it existed), written atomically."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("chat_template") or (out / "chat_template.jinja").exists():
        return
    config["chat_template"] = CHAT_TEMPLATE
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(config, indent=2))
    os.replace(partial, path)


REPO_MODEL_DIR = Path("models") / "tiny-llama"
"""Where the repository keeps the tiny Llama, relative to its root: ``make
serve``, the tests and the benchmarks build and use it there."""


def build_tiny_model(out_dir: str | os.PathLike[str], arch: str = "llama", **overrides: Any) -> Path:
    """Write a tiny random-weight model of ``arch`` to ``out_dir`` (skipped
    when a complete one is already there) and return its path."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    out = Path(out_dir)
    marker = out / ".complete"
    if marker.exists():
        _ensure_chat_template(out)
        return out
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    tokenizer = _train_tokenizer(out)
    _ensure_chat_template(out)
    params = {**_COMMON, **extra, **overrides}
    params.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = getattr(transformers, config_name)(**params)
    torch.manual_seed(SEED)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"arch": arch, "seed": SEED, **overrides}))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="default tiny")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out_dir, args.arch, **SIZES[args.size]))


if __name__ == "__main__":
    main()
