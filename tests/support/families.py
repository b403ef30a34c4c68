"""Tiny random-weight checkpoints of the model families the converter and the fast engine take
(no tests here): both sets of family tests build their models the same way."""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral")


def family_checkpoint(arch: str, tokenizer, out: Path, *, vocab_pad: int = 0, hidden: int = 128, ffn: int = 256,
                      context: int = 256, gemma2: dict | None = None, mistral: dict | None = None):
    """Save a 2-layer `arch` model with the tokenizer in `out`; returns the transformers model.

    Biases and norm weights are drawn at random: zero biases and unit norms (zero for Gemma's
    1 + w) would hide a wrong mapping of those tensors."""
    import torch
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    common = dict(vocab_size=len(tokenizer) + vocab_pad, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gemma = {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 6, "attn_logit_softcapping": 2.0,
             "final_logit_softcapping": 3.0, **(gemma2 or {})}
    cfg = {"qwen2": lambda: Qwen2Config(**common), "qwen3": lambda: Qwen3Config(**common, head_dim=48),
           "phi3": lambda: Phi3Config(**common, sliding_window=None),
           "gemma2": lambda: Gemma2Config(**{**common, "tie_word_embeddings": gemma.pop("tie", False)}, **gemma),
           # six layers: five sliding ones with their own rope base, then a global one (Gemma 3's pattern)
           "gemma3": lambda: Gemma3TextConfig(**{**common, "num_hidden_layers": 6,
                                                 "tie_word_embeddings": gemma.pop("tie", False)},
                                              **{k: v for k, v in gemma.items() if k != "attn_logit_softcapping"
                                                 and k != "final_logit_softcapping"}),
           "mistral": lambda: MistralConfig(**common, **{"sliding_window": None, **(mistral or {})})}[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.normal_(0 if name.endswith("bias") or arch.startswith("gemma") else 1, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model
