"""A self-contained Llama-family decoder with a static, slot-addressed KV cache.

Follows gpt-fast's shape: one small module, no framework.  The cache holds `max_slots` sequences
of up to `max_seq` tokens per layer, laid out `[slots, kv_heads, max_seq + 1, head_dim]`; the extra
last position is a *trash* row that padded (inactive) batch rows write into, so a decode step can
always run over a contiguous slice `cache[:P]` of slots without gathering or disturbing a slot that
is half-way through its prefill.

Works for the families of architectures.py's table (Llama, Mistral, Qwen2 with q/k/v biases, Qwen3
with q/k RMSNorm per head, Phi-3, Gemma 2 and 3 text) with GQA; the table says which options each
one switches on and which checkpoint tensors become which weights.  Grouped queries are folded
into the query-length axis (`[B, kv_heads, groups * q_len, D]`), so attention never copies K/V to
repeat them and runs on every SDPA backend (a T4 only has efficient + math).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.server.fastcore.architectures import ARCHITECTURES


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
        # int8 KV cache only: one scale per (row, kv head, position), [slots, kv_heads, max_seq + 1, 1]
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)
        # one-token (decode) attention kernel, e.g. triton_attention.decode_attention; None: SDPA
        self.decode_kernel = None

    def forward(self, x, cos, sin, rows, pos, row0, kv_idx):
        """x [B, C, dim]; cos/sin [B, C, D]; rows/pos [B, C] cache coordinates of the new tokens;
        row0: first cache row of this batch (rows are row0..row0+B-1), or a [B] tensor of the rows
        themselves; kv_idx: arange(L), the cache prefix to attend over."""
        a = self.a
        B, C, _ = x.shape
        q, k, v = self.wqkv(x).split([a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim,
                                      a.n_kv_heads * a.head_dim], dim=-1)
        q = q.view(B, C, a.n_heads, a.head_dim)
        k = k.view(B, C, a.n_kv_heads, a.head_dim)
        v = v.view(B, C, a.n_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # write the new keys/values at (row, :, pos): value shape is [B, C, kv_heads, D]
        if self.k_scale is None:
            self.k_cache[rows, :, pos] = k.to(self.k_cache.dtype)
            self.v_cache[rows, :, pos] = v.to(self.v_cache.dtype)
        else:
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            self.k_cache[rows, :, pos], self.k_scale[rows, :, pos] = kq, ks.to(self.k_scale.dtype)
            self.v_cache[rows, :, pos], self.v_scale[rows, :, pos] = vq, vs.to(self.v_scale.dtype)
        L = kv_idx.shape[0]
        kc, vc = self._cached(row0, B, L, q.dtype)
        g = a.n_heads // a.n_kv_heads
        # [B, C, Hkv*g, D] -> [B, Hkv, g*C, D]: query heads of one kv head share its K/V
        q = q.view(B, C, a.n_kv_heads, g, a.head_dim).permute(0, 2, 3, 1, 4).reshape(B, a.n_kv_heads, g * C, a.head_dim)
        if (C == 1 and self.decode_kernel is not None and self.window is None and isinstance(row0, int)
                and self.k_scale is None):  # the Triton decode kernel reads a 16-bit cache
            y = self.decode_kernel(q, self.k_cache, self.v_cache, pos.view(B), row0, L)
        else:
            mask = (kv_idx.view(1, 1, L) <= pos.view(B, C, 1))  # [B, C, L]
            if self.window is not None:
                mask = mask & (kv_idx.view(1, 1, L) > pos.view(B, C, 1) - self.window)
            mask = mask.unsqueeze(1).expand(B, g, C, L).reshape(B, 1, g * C, L)
            if a.attn_softcap:  # soft-capped scores (Gemma 2): SDPA has no such option
                scores = (q @ kc.transpose(-1, -2)) * (a.attn_scale or a.head_dim ** -0.5)
                scores = torch.tanh(scores / a.attn_softcap) * a.attn_softcap
                scores = scores.masked_fill(~mask, float("-inf"))
                y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ vc
            else:
                y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask,
                                                   scale=a.attn_scale)
        y = y.view(B, a.n_kv_heads, g, C, a.head_dim).permute(0, 3, 1, 2, 4).reshape(B, C, a.n_heads * a.head_dim)
        return self.wo(y)

    def _cached(self, row0, B: int, L: int, dtype: torch.dtype):
        """K and V of the batch's rows, positions 0..L-1, in `dtype`: a view of consecutive rows
        (row0 an int), or the rows in tensor row0 gathered (the compiled prefill: one graph for
        every slot); an int8 cache is scaled back here."""
        pick = (lambda t: t[row0:row0 + B, :, :L]) if isinstance(row0, int) else (lambda t: t[row0, :, :L])
        kc, vc = pick(self.k_cache), pick(self.v_cache)
        if self.k_scale is None:
            return kc.to(dtype), vc.to(dtype)
        return kc.to(dtype) * pick(self.k_scale).to(dtype), vc.to(dtype) * pick(self.v_scale).to(dtype)


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.ffn_dim, self.gelu = a.ffn_dim, a.gelu
        self.w13 = nn.Linear(a.dim, 2 * a.ffn_dim, bias=False)  # gate and up fused
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(act * up)


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

    def forward(self, x, cos, sin, rows, pos, row0, kv_idx):
        y = self.attention(self.attention_norm(x), cos, sin, rows, pos, row0, kv_idx)
        h = x + (self.post_attention_norm(y) if self.post_attention_norm is not None else y)
        y = self.feed_forward(self.ffn_norm(h))
        return h + (self.post_ffn_norm(y) if self.post_ffn_norm is not None else y)


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps, a.norm_offset)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.max_seq = 0
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.register_buffer("rope_cos_local", None, persistent=False)  # Gemma 3's sliding layers
        self.register_buffer("rope_sin_local", None, persistent=False)

    def setup_caches(self, max_slots: int, max_seq: int, rope: dict, dtype: torch.dtype, device,
                     kv_dtype: torch.dtype | None = None) -> None:
        """Allocate the static KV cache and the rotary tables (max_seq + 1: the trash row).  rope:
        {"full": (inv_freq, scale)}, and "sliding" for sliding-window layers rotated otherwise.
        kv_dtype torch.int8: the cache in int8 with a scale per row, head and position (half the
        memory of fp16); default: `dtype`."""
        a = self.a
        self.max_seq = max_seq
        for i in a.sliding_layers:  # a window as long as the context changes nothing: left off then
            self.layers[i].attention.window = a.sliding_window if max_seq > a.sliding_window else None
        shape = (max_slots, a.n_kv_heads, max_seq + 1, a.head_dim)
        int8 = kv_dtype == torch.int8
        for layer in self.layers:
            att = layer.attention
            att.k_cache = torch.zeros(shape, dtype=torch.int8 if int8 else dtype, device=device)
            att.v_cache = torch.zeros(shape, dtype=torch.int8 if int8 else dtype, device=device)
            att.k_scale = torch.zeros(shape[:-1] + (1,), dtype=dtype, device=device) if int8 else None
            att.v_scale = torch.zeros(shape[:-1] + (1,), dtype=dtype, device=device) if int8 else None
        t = torch.arange(max_seq + 1, device=device, dtype=torch.float32)

        def table(inv_freq, scale):
            freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

        self.rope_cos, self.rope_sin = table(*rope["full"])
        if "sliding" in rope:
            self.rope_cos_local, self.rope_sin_local = table(*rope["sliding"])

    def forward(self, tokens, pos, row0, kv_idx, last: torch.Tensor | None = None, hidden: bool = False):
        """tokens/pos [B, C] for cache rows row0..row0+B-1 (or the rows in a [B] tensor row0) ->
        logits [B, C, vocab], or [B, 1, vocab] at index `last` [B] of each row: a prompt needs only
        its last real position's (padding may follow it), and the vocab matmul is big."""
        B, C = tokens.shape
        first = row0 if torch.is_tensor(row0) else torch.arange(B, device=tokens.device) + row0
        rows = first.view(B, 1).expand(B, C)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        local = (self.rope_cos_local[pos], self.rope_sin_local[pos]) if self.rope_cos_local is not None else None
        x = self.tok_embeddings(tokens)
        if self.a.embed_scale is not None:  # in the activations' dtype, as Gemma's own model rounds it
            x = x * torch.tensor(self.a.embed_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            c, s = local if local is not None and i in self.a.sliding_layers else (cos, sin)
            x = layer(x, c, s, rows, pos, row0, kv_idx)
        if last is not None:
            x = x.gather(1, last.view(B, 1, 1).expand(B, 1, x.shape[-1]))
        x = self.norm(x)
        if hidden:  # the final hidden states (embeddings)
            return x
        logits = self.output(x)
        if self.a.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / self.a.final_softcap) * self.a.final_softcap
        return logits
