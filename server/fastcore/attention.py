"""Attention over the paged KV cache for a flattened batch: each token attends to the cached
positions of its own sequence up to its own position (and within the layer's sliding window).

Two implementations of one contract, `attend(q, att, batch, table) -> [T, heads, head_dim]`:

    attend_torch   gathers each sequence's blocks into a padded [S, kv_heads, L, D] view and runs
                   SDPA with a causal mask: the reference, and the CPU path (exact against
                   transformers; one compiled graph for every batch shape, batch.py's size carriers)
    attend_triton  one Triton kernel over the block table, no gather (triton_paged_attention.py):
                   the GPU path, and what decode steps' CUDA graphs record

q is [T, heads, head_dim] with the query heads of one KV head adjacent (head h reads KV head
h // G); `att` is the layer (its caches, window, scale and soft-cap); `table` the block table.

On a GPU a decode step (one token a sequence) goes further in one kernel, `attend_new(qkv, cos,
sin, att, batch, table)`: from wqkv's output, q and the new key turned by the rotary embedding, the
new key and value written to the cache, and the attention, where the model would run the rotary
and cache-write kernels first (model.Attention; not for q/k norms or int8 caches).  At batch 1 those
were two of a layer's ~8 kernels (bench/RESULTS.md, 2026-12-06).  QUANTSERVE_ATTENTION_NEW_KV=0
keeps the separate kernels (to compare).

Decode steps split each sequence's keys over several programs (flash-decoding) and merge them in a
second kernel, but only when some sequence holds more than `short_context()` keys: below that one
program a (sequence, KV head) walks them all, and the merge kernel's launch, a few microseconds a
layer, is saved.  graphs.py records a decode graph for each side of that line.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from quantserve.server.fastcore.blocks import BLOCK


def attend_torch(q: torch.Tensor, att, batch, table: torch.Tensor) -> torch.Tensor:
    a = att.a
    T, H, D = q.shape
    Hkv, G = a.n_kv_heads, H // a.n_kv_heads
    S, C, NB = batch.seq_slot.shape[0], batch.q_cols.shape[0], batch.kv_blocks.shape[0]
    L = NB * BLOCK
    blocks = table[batch.seq_slot][:, :NB].long()  # [S, NB]; blocks not given yet are the trash block
    k = att.k_cache[blocks].reshape(S, L, Hkv, D).to(q.dtype)
    v = att.v_cache[blocks].reshape(S, L, Hkv, D).to(q.dtype)
    if att.k_scale is not None:  # int8 cache: values times their scale per position and head
        k = k * att.k_scale[blocks].reshape(S, L, Hkv, 1).to(q.dtype)
        v = v * att.v_scale[blocks].reshape(S, L, Hkv, 1).to(q.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [S, Hkv, L, D]
    # each sequence's queries padded to C rows, the G heads of a KV head folded into the rows:
    # [S, C, H, D] -> [S, Hkv, G * C, D], so K/V are never repeated per query head
    qp = q.new_zeros(S, C, H, D)
    qp[batch.tok_seq, batch.tok_col] = q
    qp = qp.view(S, C, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, G * C, D)
    qpos = batch.pos.new_zeros(S, C)  # padding rows look at position 0 only (no empty softmax)
    qpos[batch.tok_seq, batch.tok_col] = batch.pos
    kv = torch.arange(L, device=q.device).view(1, 1, L)
    mask = kv <= qpos.view(S, C, 1)  # [S, C, L]
    if att.window is not None:
        mask = mask & (kv > qpos.view(S, C, 1) - att.window)
    mask = mask.unsqueeze(1).expand(S, G, C, L).reshape(S, 1, G * C, L)
    if a.attn_softcap:  # soft-capped scores (Gemma 2): SDPA has no such option
        scores = (qp @ k.transpose(-1, -2)) * (a.attn_scale or D ** -0.5)
        scores = torch.tanh(scores / a.attn_softcap) * a.attn_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    else:
        y = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=a.attn_scale)
    y = y.view(S, Hkv, G, C, D).permute(0, 3, 1, 2, 4).reshape(S, C, H, D)
    return y[batch.tok_seq, batch.tok_col]


def new_kv_inside() -> bool:
    """$QUANTSERVE_ATTENTION_NEW_KV: 1 (default) a decode step's rotary and cache write inside the
    attention kernel, 0 as separate kernels."""
    value = os.environ.get("QUANTSERVE_ATTENTION_NEW_KV", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"QUANTSERVE_ATTENTION_NEW_KV={value!r}: use 1 or 0")
    return value == "1"


# keys: decode steps whose sequences hold no more attend without split keys.  On an H100 at the
# 8B shape one program a sequence and KV head took 0.70x / 0.92x the split keys' time (and their
# merge's) at batch 1 with 64 / 128 keys, 1.06x at 192 and 1.23x at 256; at batch 8 it won to 256
# (bench.attention_split, bench/RESULTS.md 2026-12-06)
SHORT_CONTEXT = 128


def short_context() -> int:
    """$QUANTSERVE_ATTENTION_SHORT_CONTEXT (default SHORT_CONTEXT): the most keys a sequence may
    hold for a decode step to attend without split keys (0: always split, as before, also where
    the programs fill the GPU: triton_paged_attention._splits)."""
    value = os.environ.get("QUANTSERVE_ATTENTION_SHORT_CONTEXT", str(SHORT_CONTEXT)).strip()
    if not (value.isascii() and value.isdigit()) or int(value) % BLOCK:
        raise ValueError(f"QUANTSERVE_ATTENTION_SHORT_CONTEXT={value!r}: use a multiple of {BLOCK} keys (0: off)")
    return int(value)


def merge_in_one_round() -> bool:
    """$QUANTSERVE_ATTENTION_MERGE_ROUND: 1 merges split keys with every chunk's partial sums loaded
    in one round (triton_paged_attention._merge_round_kernel), 0 (default, until measured on a GPU)
    one chunk at a time (_merge_kernel)."""
    value = os.environ.get("QUANTSERVE_ATTENTION_MERGE_ROUND", "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"QUANTSERVE_ATTENTION_MERGE_ROUND={value!r}: use 1 or 0")
    return value == "1"


def decode_tile() -> tuple[int, int] | None:
    """$QUANTSERVE_ATTENTION_DECODE_TILE, "KEYSxWARPS": the keys a decode step's attention program
    takes a step (16-256, a power of two) and its warps (1-16, a power of two).  Unset: None, the
    kernel's own for the GPU (triton_paged_attention._program_shape); prompt tiles keep theirs."""
    value = os.environ.get("QUANTSERVE_ATTENTION_DECODE_TILE", "").strip()
    if not value:
        return None
    keys, _, warps = value.partition("x")
    ok = keys.isascii() and keys.isdigit() and warps.isascii() and warps.isdigit()
    if not ok or int(keys) not in (16, 32, 64, 128, 256) or int(warps) not in (1, 2, 4, 8, 16):
        raise ValueError(f"QUANTSERVE_ATTENTION_DECODE_TILE={value!r}: use KEYSxWARPS, keys 16-256 and warps "
                         "1-16, each a power of two (e.g. 64x4)")
    return int(keys), int(warps)


def use_attention(model, choice: str, device: torch.device) -> str:
    """Set every layer's attention: "triton" (triton_paged_attention.py), "torch" (attend_torch)
    or "auto" (triton on a CUDA GPU with Triton).  Returns the choice made."""
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown attention {choice!r} (auto, triton or torch)")
    if choice == "auto":
        from quantserve.server.fastcore.quant import triton_ops

        choice = "triton" if device.type == "cuda" and triton_ops() is not None else "torch"
    if choice == "triton" and device.type != "cuda":
        raise ValueError("the Triton attention kernel runs on a CUDA GPU only")
    fn, new = attend_torch, None
    if choice == "triton":
        from quantserve.server.fastcore.triton_paged_attention import attend_new_triton, attend_triton

        fn, new = attend_triton, attend_new_triton if new_kv_inside() else None
    for layer in model.layers:
        layer.attention.attend, layer.attention.attend_new = fn, new
    return choice
