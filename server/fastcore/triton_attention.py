"""Decode attention (one new token per sequence) as a split-KV Triton kernel, "flash-decoding".

At decode a sequence has a single query per head, so PyTorch's memory-efficient SDPA kernel (the
fastest a T4 has) runs one program per (sequence, KV head) that walks the whole cache alone: on
the GPU it was measured at ~24 us a layer for a 1-sequence, ~200-token step, a seventh of the 8B
shape's step (bench/RESULTS.md).  Here the cache prefix is cut into NSPLIT chunks, each program
attends its group's query heads over one chunk (online softmax, fp32), and a second small kernel
merges the chunks by their log-sum-exp.

Layout (server/fastcore/model.py): queries [B, Hkv, G, D] with the G query heads of one KV head
folded together, caches [slots, Hkv, max_seq + 1, D], batch row b reads cache row row0 + b, and
attends keys 0..min(pos[b], L - 1).  Import only where Triton runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per inner step


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, m_ptr, l_ptr,
                    row0, H, G, L, chunk, s_kr, s_kh, s_kn, scale,
                    NSPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    FP32: tl.constexpr):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + (bh * G + rg[:, None]) * D + rd[None, :], mask=rg[:, None] < G, other=0.0)
    last = tl.minimum(tl.load(pos_ptr + b), L - 1)  # the newest key this row may see
    kv = k_ptr + (row0 + b) * s_kr + h * s_kh
    vv = v_ptr + (row0 + b) * s_kr + h * s_kh
    m = tl.full((BLOCK_G,), -1.0e30, tl.float32)  # finite: a chunk with no visible key stays NaN-free
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    start = split * chunk
    for n0 in range(start, start + chunk, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        visible = rn <= last
        k = tl.load(kv + rn[:, None] * s_kn + rd[None, :], mask=visible[:, None], other=0.0)
        if FP32:  # fp32 caches (tests): no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_G, BLOCK_N], fp32 accumulation
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(vv + rn[:, None] * s_kn + rd[None, :], mask=visible[:, None], other=0.0)
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    part = bh * NSPLIT + split
    tl.store(acc_ptr + (part * BLOCK_G + rg[:, None]) * D + rd[None, :], acc)
    tl.store(m_ptr + part * BLOCK_G + rg, m)
    tl.store(l_ptr + part * BLOCK_G + rg, l)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, G,
                  NSPLIT: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
    bh = tl.program_id(0)
    rg = tl.arange(0, BLOCK_G)
    rd = tl.arange(0, D)
    rs = tl.arange(0, NSPLIT)
    base = bh * NSPLIT + rs  # [NSPLIT]
    m = tl.load(m_ptr + base[:, None] * BLOCK_G + rg[None, :])  # [NSPLIT, BLOCK_G]
    l = tl.load(l_ptr + base[:, None] * BLOCK_G + rg[None, :])
    m_all = tl.max(m, 0)
    w = tl.exp(m - m_all[None, :])  # each chunk's weight; 0 for chunks that saw no key
    denom = tl.sum(l * w, 0)
    out = tl.zeros((BLOCK_G, D), tl.float32)
    for s in range(NSPLIT):
        part = bh * NSPLIT + s
        a = tl.load(acc_ptr + (part * BLOCK_G + rg[:, None]) * D + rd[None, :])
        ws = tl.load(m_ptr + part * BLOCK_G + rg)
        out += a * tl.exp(ws - m_all)[:, None]
    out = out / denom[:, None]
    tl.store(out_ptr + (bh * G + rg[:, None]) * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rg[:, None] < G)


def _splits(rows: int, L: int, sms: int) -> int:
    """Chunks per (sequence, KV head): enough programs for two waves over the GPU, each chunk at
    least one BLOCK_N of keys; a power of two (the merge kernel loads them as one block)."""
    want = max(1, min(-(-L // BLOCK_N), -(-2 * sms // rows)))
    return 1 << (want - 1).bit_length()


@torch.library.custom_op("quantserve::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     row0: int, length: int) -> torch.Tensor:
    """q [B, Hkv, G, D]; caches [slots, Hkv, max_seq + 1, D]; pos [B] -> [B, Hkv, G, D]."""
    B, H, G, D = q.shape
    q = q.contiguous()
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    nsplit = _splits(B * H, length, sms)
    chunk = -(-(-(-length // nsplit)) // BLOCK_N) * BLOCK_N  # keys per chunk, whole blocks
    block_g = max(16, triton.next_power_of_2(G))  # tl.dot needs 16 rows
    acc = torch.empty((B * H, nsplit, block_g, D), device=q.device, dtype=torch.float32)
    m = torch.empty((B * H, nsplit, block_g), device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    _partial_kernel[(B * H, nsplit)](q, k_cache, v_cache, pos, acc, m, l, row0, H, G, length, chunk,
                                     k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D ** -0.5,
                                     NSPLIT=nsplit, BLOCK_G=block_g, BLOCK_N=BLOCK_N, D=D,
                                     FP32=q.dtype == torch.float32, num_warps=4)
    out = torch.empty_like(q)
    _merge_kernel[(B * H,)](acc, m, l, out, G, NSPLIT=nsplit, BLOCK_G=block_g, D=D, num_warps=4)
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, pos, row0, length):
    return torch.empty_like(q)
