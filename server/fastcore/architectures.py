"""The model families the fast core runs: one entry per config.json `model_type`.

Every family is model.py's Llama-style decoder with some of its options switched on.  An entry
says how that family's config and checkpoint map onto it:

    fixed        ModelArgs fields that hold for every checkpoint of the family
    from_config  ModelArgs fields read from its config, beyond the ones ModelArgs.from_hf reads
                 for every family (vocabulary, widths, layers, heads, norm eps, tied embeddings)
    linears      our fused linear layers <- the checkpoint tensors whose rows each one stacks
    norms        our norms <- the checkpoint's

Tensor names are the Hugging Face ones under `model.layers.{i}.`, without ".weight"; a layer's
q/k/v biases (ModelArgs.qkv_bias) are the ".bias" tensors of its wqkv parts.  The embedding, the
final norm and the output layer are Llama's `model.embed_tokens`, `model.norm` and `lm_head` in
every family so far (weights.py).

A family that needs no new kind of layer is one more entry here: FAST_MODEL_TYPES (model.py),
the weight loading (weights.py) and `--engine auto` follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# q, k and v in one matmul, gate and up in another (model.Attention, model.FeedForward)
LLAMA_LINEARS = {
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.wo": ("self_attn.o_proj",),
    "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.w2": ("mlp.down_proj",),
}
# Phi-3 stores them fused already: q, k and v in one matrix, gate and up in another (gate first)
PHI3_LINEARS = {**LLAMA_LINEARS, "attention.wqkv": ("self_attn.qkv_proj",),
                "feed_forward.w13": ("mlp.gate_up_proj",)}

# Llama's "post_attention_layernorm" is the norm before the MLP
LLAMA_NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2's "post_attention_layernorm" follows the attention: a norm after each sublayer too ("sandwich")
GEMMA_NORMS = {"attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm"}
# Qwen3 / Gemma 3: RMSNorm over each head of q and k, before the rotation
QK_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}


def _nothing(cfg) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    linears: dict[str, tuple[str, ...]]
    norms: dict[str, str]
    fixed: dict[str, Any] = field(default_factory=dict)
    from_config: Callable[[Any], dict] = _nothing

    def args(self, cfg) -> dict:
        """This family's ModelArgs fields for the HF config `cfg`."""
        return {**self.fixed, **self.from_config(cfg)}


def _every_layer_slides(cfg) -> dict:
    """Mistral: a sliding window over every layer, when its config sets one."""
    if not getattr(cfg, "sliding_window", None):
        return {}
    return dict(sliding_window=cfg.sliding_window, sliding_layers=tuple(range(cfg.num_hidden_layers)))


# Gemma 2: norms scale by (1 + w), GELU (tanh) gating, sandwich norms ...
GEMMA = dict(norm_offset=1.0, gelu=True, sandwich_norms=True)


def _gemma(cfg) -> dict:
    """... the embedding scaled by sqrt(dim), its own query scale, attention scores and logits
    soft-capped, and the layers its config names "sliding_attention" attending over a window."""
    types = list(getattr(cfg, "layer_types", None) or [])
    return dict(embed_scale=cfg.hidden_size ** 0.5, attn_scale=cfg.query_pre_attn_scalar ** -0.5,
                attn_softcap=cfg.attn_logit_softcapping, final_softcap=cfg.final_logit_softcapping,
                sliding_window=cfg.sliding_window,
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(LLAMA_LINEARS, LLAMA_NORMS),
    "mistral": Architecture(LLAMA_LINEARS, LLAMA_NORMS, from_config=_every_layer_slides),
    "qwen2": Architecture(LLAMA_LINEARS, LLAMA_NORMS, fixed=dict(qkv_bias=True)),
    "qwen3": Architecture(LLAMA_LINEARS, {**LLAMA_NORMS, **QK_NORMS}, fixed=dict(qk_norm=True)),
    "phi3": Architecture(PHI3_LINEARS, LLAMA_NORMS),
    "gemma2": Architecture(LLAMA_LINEARS, GEMMA_NORMS, fixed=GEMMA, from_config=_gemma),
    # Gemma 3 adds q/k norms, and a rope of its own for the sliding layers (weights.py reads both ropes)
    "gemma3_text": Architecture(LLAMA_LINEARS, {**GEMMA_NORMS, **QK_NORMS}, fixed=dict(GEMMA, qk_norm=True),
                                from_config=_gemma),
}
