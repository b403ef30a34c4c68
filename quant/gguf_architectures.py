"""The GGUF writer's architecture table: one record per Hugging Face architecture it converts.

Each record says which llama.cpp graph runs the model and what that graph expects differently
from the Hugging Face layout.  Adding an architecture whose llama.cpp graph reads only the
common hyper-parameters is one line here; one that needs more adds its `hparams` hook beside it.

What differs, family by family: Mistral is Llama with another config; Qwen2 adds q/k/v biases and
uses the NEOX rotary layout (no Q/K permutation); Qwen3 drops the biases and adds an RMSNorm over
each head of q and k (attn_q_norm / attn_k_norm), NEOX as Qwen2; Phi-3 fuses q/k/v (attn_qkv) and
gate/up (ffn_up, split by the graph), NEOX too; Gemma 2 has norms after attention and the MLP,
soft-capping and a sliding window on even layers (all in its graph); Gemma 3's text model adds
q/k norms and a local rope.  Tensor names come from gguf's own `TensorNameMap` for every one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from quantserve.quant.source import Checkpoint
from quantserve.settings import UserError


def _query_scale_is_head_dim(ckpt: Checkpoint, c: dict, hp: dict, graph: str) -> None:
    if int(c.get("query_pre_attn_scalar", hp["head_dim"])) != hp["head_dim"]:
        raise UserError(f"{ckpt.origin}: query_pre_attn_scalar {c.get('query_pre_attn_scalar')} differs from "
                        f"head_dim {hp['head_dim']}: llama.cpp's {graph} graph would scale queries differently")


def _gemma2(ckpt: Checkpoint, c: dict, hp: dict, window: int | None, local_rope: dict | None) -> None:
    # llama.cpp's gemma2 graph has the window (even layers) and the soft-caps; it scales queries
    # by head_dim ** -0.5 (or by n_embd / n_head for the 27B shape alone)
    hp.update(sliding_window=int(window), attn_softcap=c.get("attn_logit_softcapping"),
              final_softcap=c.get("final_logit_softcapping"))
    _query_scale_is_head_dim(ckpt, c, hp, "gemma2")


def _gemma3(ckpt: Checkpoint, c: dict, hp: dict, window: int | None, local_rope: dict | None) -> None:
    # llama.cpp's gemma3 graph fixes what the config may vary: five sliding layers then a global
    # one, the sliding layers rotated with base 10000, queries scaled by head_dim ** -0.5
    types = list(c.get("layer_types") or [])
    pattern = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(hp["n_layer"])]
    local_base = float((local_rope or {}).get("rope_theta", 10000.0))
    if types and types != pattern or local_base != 10000.0:
        raise UserError(f"{ckpt.origin}: this Gemma 3 differs from what llama.cpp's gemma3 graph assumes "
                        "(5 sliding layers then a global one, local rope base 10000)")
    _query_scale_is_head_dim(ckpt, c, hp, "gemma3")
    hp.update(sliding_window=int(window), attn_softcap=None, final_softcap=c.get("final_logit_softcapping"))


def _no_window(ckpt: Checkpoint, c: dict, hp: dict, window: int | None, local_rope: dict | None) -> None:
    if window:  # the llama graph has no sliding window: only claim the context where it is exact
        hp["n_ctx"] = min(hp["n_ctx"], int(window))


@dataclass(frozen=True)
class GGUFArchitecture:
    name: str                       # llama.cpp's architecture name (`general.architecture`)
    permute_qk: bool = False        # HF rotates halves of each head; the llama graph interleaved pairs
    norms_plus_one: bool = False    # Gemma's norms scale by (1 + w); llama.cpp's by the stored weight
    sliding_window: bool = False    # the graph reads a sliding window and soft-caps from the file
    tied_output: bool = False       # the graph has no output matrix: logits come from the embedding
    # (ckpt, text config, hyper-parameters so far, sliding window, local rope) -> checks, updates hp
    hparams: Callable[..., None] = _no_window


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "LlamaForCausalLM": GGUFArchitecture("llama", permute_qk=True),
    "MistralForCausalLM": GGUFArchitecture("llama", permute_qk=True),
    "Qwen2ForCausalLM": GGUFArchitecture("qwen2"),
    "Qwen3ForCausalLM": GGUFArchitecture("qwen3"),
    "Phi3ForCausalLM": GGUFArchitecture("phi3"),
    "Gemma2ForCausalLM": GGUFArchitecture("gemma2", norms_plus_one=True, sliding_window=True, tied_output=True,
                                          hparams=_gemma2),
    # the text model (Gemma 3 1B); the multimodal ones are not read
    "Gemma3ForCausalLM": GGUFArchitecture("gemma3", norms_plus_one=True, sliding_window=True, tied_output=True,
                                          hparams=_gemma3),
}


def gguf_architecture(ckpt: Checkpoint) -> GGUFArchitecture:
    """The record for `ckpt`'s architecture, or a UserError naming the ones converted."""
    arch = GGUF_ARCHITECTURES.get(ckpt.architecture)
    if arch is None:
        raise UserError(f"{ckpt.origin}: unsupported architecture {ckpt.architecture} for GGUF "
                        f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    return arch
