"""Tiny checkpoints no command may take, for the tests of their refusals: an encoder (BERT), an
encoder-decoder (T5), both with the default model's tokenizer, the default model with its
safetensors file cut short, and the default model without its tokenizer files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def odd_models(root: Path, default_model: Path) -> Path:
    """`root` holding bert/, t5/, trunc/ and notok/."""
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                         vocab_size=100)).save_pretrained(root / "bert")
    T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2,
                                        vocab_size=100)).save_pretrained(root / "t5")
    for name in ("bert", "t5"):  # a model and a tokenizer: only the architecture is wrong
        for f in Path(default_model).glob("tokenizer*"):
            shutil.copy(f, root / name / f.name)
    shutil.copytree(default_model, root / "trunc")
    weights = root / "trunc" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shutil.copytree(default_model, root / "notok", ignore=shutil.ignore_patterns("tokenizer*", "vocab*",
                                                                                  "special_tokens_map.json"))
    return root
