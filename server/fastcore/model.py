"""A self-contained Llama-family decoder over a paged KV cache and a flattened token batch.

Follows gpt-fast's shape: one small module, no framework.  A forward takes one `StepBatch`
(batch.py): the tokens of several sequences laid end to end, each with its own position and
sequence, some sequences with one new token (decoding), some with a prompt chunk.  Every layer
writes the new keys and values into the paged cache through the block table (blocks.py: position
p of the sequence in block-table row r is at block `block_table[r, p // BLOCK]`, offset
`p % BLOCK`), then each token attends over its own sequence's cached positions (attention.py).
Only each sequence's last token goes through the final norm and the vocabulary matmul, unless
every position is asked for (prompt log-probabilities, embeddings).

The cache per layer is `[num_blocks + 1, BLOCK, kv_heads, head_dim]`; the extra last block is a
*trash* block that padding tokens (a CUDA graph's unused batch rows) write into and read.

Works for the families of architectures.py's table (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3
with q/k RMSNorm per head, Phi-3, Gemma 2 and 3 text) with GQA; the table says which options each
one switches on and which checkpoint tensors become which weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantserve.server.fastcore import attention, fused
from quantserve.server.fastcore.architectures import ARCHITECTURES
from quantserve.server.fastcore.blocks import BLOCK


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    qkv_bias: bool = False
    tie_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before the rotation
    # Gemma 2: norms scale by (1 + w), the embedding by sqrt(dim), GELU (tanh) gating, norms after
    # attention and the MLP too ("sandwich"), attention scores and logits soft-capped, and every
    # other layer attends over a sliding window
    norm_offset: float = 0.0
    embed_scale: float | None = None
    gelu: bool = False
    sandwich_norms: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg) -> "ModelArgs":
        """The fields for a Hugging Face config: the ones every family reads alike, then its own
        (architectures.py)."""
        if cfg.model_type not in FAST_MODEL_TYPES:
            raise ValueError(f"fastcore supports {'/'.join(FAST_MODEL_TYPES)} configs, not {cfg.model_type!r}")
        if float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported by fastcore")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if (rope.get("rope_type") or rope.get("type")) in ("longrope", "su", "dynamic"):
            # their frequencies change with the sequence's length; the core's rope table is fixed
            raise ValueError(f"rope scaling {rope.get('rope_type') or rope.get('type')!r} is not supported by fastcore")
        heads = cfg.num_attention_heads
        shared = dict(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, ffn_dim=cfg.intermediate_size,
            n_layers=cfg.num_hidden_layers, n_heads=heads,
            n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            norm_eps=cfg.rms_norm_eps, qkv_bias=bool(getattr(cfg, "attention_bias", False)),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )
        return cls(**{**shared, **ARCHITECTURES[cfg.model_type].args(cfg)})

    def kv_bytes_per_token(self, dtype_bytes: int = 2, int8: bool = False) -> int:
        """Cache bytes one token takes over all layers: K and V of every kv head (int8: one byte a
        value plus a `dtype_bytes` scale per head and position)."""
        per_head = self.head_dim + dtype_bytes if int8 else self.head_dim * dtype_bytes
        return self.n_layers * 2 * self.n_kv_heads * per_head


FAST_MODEL_TYPES = tuple(ARCHITECTURES)  # config.json model_type values this core runs


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 values, the scale of each head_dim vector): symmetric, absmax / 127."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.folded = False  # the weight multiplied into the layer after this norm (its own is then 1)

    def forward(self, x):
        # fp32 statistics like Hugging Face's LlamaRMSNorm, so greedy tokens match it exactly
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: (1 + w), multiplied in fp32 before the cast, as its own norm does
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        # q, k and v in one matmul: one weight read, one kernel (decode is launch-bound on big GPUs)
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_offset) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_offset) if a.qk_norm else None
        self.window: int | None = None  # set per layer: this layer attends over a sliding window
        # buffers, not plain attributes: module state that torch.compile reads in place, so a
        # captured CUDA graph writes the cache itself (no copy in and out on every step)
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)
        # int8 KV cache only: one scale per (block, offset, kv head), [num_blocks + 1, BLOCK, kv_heads]
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)
        self.attend = attention.attend_torch  # attention.py; the Triton kernel on a GPU (use_attention)
        self.attend_new = None  # a decode step's rotary, cache write and attention in one (attention.py)

    def forward(self, qkv, cos, sin, at, batch, table):
        """qkv: wqkv's output [T, (heads + 2 kv heads) * head_dim] (Block applies wqkv, with the
        norm before it); cos/sin [T, D]; at: ([T] blocks, [T] offsets) where each new token's K/V
        go; batch: the StepBatch (which sequence each token is of); table: the block table.
        Returns the attention's output before wo, [T, heads * head_dim] (Block applies wo, with
        the residual add after it)."""
        a = self.a
        T = qkv.shape[0]
        if self.attend_new is not None and batch.q_cols.shape[0] == 1 and self.q_norm is None \
                and self.k_scale is None:  # one token a sequence, float caches: one kernel for all of it
            return self.attend_new(qkv, cos, sin, self, batch, table).reshape(T, a.n_heads * a.head_dim)
        q, k, v = qkv.split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim], dim=-1)
        q = q.view(T, a.n_heads, a.head_dim)
        k = k.view(T, a.n_kv_heads, a.head_dim)
        v = v.view(T, a.n_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # indexed on the cache tensors themselves, not on a flattened view of them: under
        # torch.compile a write through a view became a copy of the whole cache (functionalized,
        # then copied back), twice a layer: ~4 GB a decode step for the 1B shape's pool
        blk, off = at
        if self.k_scale is None:
            self.k_cache[blk, off] = k.to(self.k_cache.dtype)
            self.v_cache[blk, off] = v.to(self.v_cache.dtype)
        else:
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            self.k_cache[blk, off], self.v_cache[blk, off] = kq, vq
            self.k_scale[blk, off] = ks.squeeze(-1).to(self.k_scale.dtype)
            self.v_scale[blk, off] = vs.squeeze(-1).to(self.v_scale.dtype)
        y = self.attend(q, self, batch, table)  # [T, n_heads, head_dim]
        return y.reshape(T, a.n_heads * a.head_dim)


class FeedForward(nn.Module):
    """The gated MLP's weights: w2(act(gate) * up), gate and up from one matmul (Block runs it,
    through fused.py)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gelu = a.gelu
        self.w13 = nn.Linear(a.dim, 2 * a.ffn_dim, bias=False)  # gate and up fused
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.feed_forward = FeedForward(a)
        # Gemma 2's sandwich: each sublayer's output normalized again before the residual add
        self.post_attention_norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset) if a.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset) if a.sandwich_norms else None

    def forward(self, x, cos, sin, at, batch, table):
        # norm -> qkv, wo -> residual add, norm -> gate-up -> silu(gate) * up, w2 -> residual add:
        # each one kernel for a single token where the weights' kernel can take it (fused.py)
        att, ff = self.attention, self.feed_forward
        y = att(fused.norm_linear(self.attention_norm, att.wqkv, x), cos, sin, at, batch, table)
        h = fused.linear_add(att.wo, y, x, self.post_attention_norm)
        act = fused.norm_gated_linear(self.ffn_norm, ff.w13, h, ff.gelu)
        return fused.linear_add(ff.w2, act, h, self.post_ffn_norm)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq = 0
        self.register_buffer("block_table", None, persistent=False)  # [max_seqs + 1, blocks per sequence]
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.register_buffer("rope_cos_local", None, persistent=False)  # Gemma 3's sliding layers
        self.register_buffer("rope_sin_local", None, persistent=False)

    def setup_caches(self, num_blocks: int, max_seqs: int, max_seq: int, rope: dict, dtype: torch.dtype, device,
                     kv_dtype: torch.dtype | None = None) -> None:
        """Allocate the paged KV cache (num_blocks blocks of BLOCK positions, plus the trash block),
        the block table (max_seqs rows, plus a trash row for padding, every entry the trash block
        until a block is given) and the rotary tables for positions 0..max_seq - 1.
        rope: {"full": (inv_freq, scale)}, and "sliding" for sliding-window layers rotated
        otherwise.  kv_dtype torch.int8: the cache in int8 with a scale per position and head
        (half the memory of fp16); default: `dtype`."""
        a = self.a
        self.max_seq = max_seq
        for i in a.sliding_layers:  # a window as long as the context changes nothing: left off then
            self.layers[i].attention.window = a.sliding_window if max_seq > a.sliding_window else None
        shape = (num_blocks + 1, BLOCK, a.n_kv_heads, a.head_dim)
        int8 = kv_dtype == torch.int8
        for layer in self.layers:
            att = layer.attention
            att.k_cache = torch.zeros(shape, dtype=torch.int8 if int8 else dtype, device=device)
            att.v_cache = torch.zeros(shape, dtype=torch.int8 if int8 else dtype, device=device)
            att.k_scale = torch.zeros(shape[:-1], dtype=dtype, device=device) if int8 else None
            att.v_scale = torch.zeros(shape[:-1], dtype=dtype, device=device) if int8 else None
        self.block_table = torch.full((max_seqs + 1, -(-max_seq // BLOCK)), num_blocks, dtype=torch.int32,
                                      device=device)
        t = torch.arange(max_seq, device=device, dtype=torch.float32)

        def table(inv_freq, scale):
            freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

        self.rope_cos, self.rope_sin = table(*rope["full"])
        if "sliding" in rope:
            self.rope_cos_local, self.rope_sin_local = table(*rope["sliding"])

    def forward(self, batch, all_positions: bool = False, hidden: bool = False):
        """batch: a StepBatch (batch.py) -> logits [S, vocab] at each sequence's last token, or
        with all_positions [T, vocab] at every token (or the final hidden states with hidden)."""
        pos = batch.pos
        at = (self.block_table[batch.tok_slot, pos // BLOCK].long(), pos % BLOCK)  # each token's block, offset
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        local = (self.rope_cos_local[pos], self.rope_sin_local[pos]) if self.rope_cos_local is not None else None
        x = self.tok_embeddings(batch.tokens)
        if self.a.embed_scale is not None:  # in the activations' dtype, as Gemma's own model rounds it
            x = x * torch.tensor(self.a.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            c, s = local if local is not None and i in self.a.sliding_layers else (cos, sin)
            x = layer(x, c, s, at, batch, self.block_table)
        if not all_positions:  # only the last token of each sequence: the vocab matmul is big
            x = x[batch.last]
        if hidden:  # the final hidden states (embeddings)
            return self.norm(x)
        logits = fused.norm_linear(self.norm, self.output, x)
        if self.a.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / self.a.final_softcap) * self.a.final_softcap
        return logits
