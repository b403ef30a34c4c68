"""Attention over the paged KV cache as one Triton kernel, for any flattened batch: decodes and
prompt chunks of many sequences together, each token over its own sequence's blocks.

The work list is `batch.tiles` (batch.py): each tile is up to BLOCK_Q consecutive tokens of one
sequence.  A program takes one tile and one KV head, with the G query heads of that KV head folded
into its rows (BLOCK_Q tokens x G heads: the K/V tile it loads serves them all), and walks the
sequence's keys up to the tile's last position through the block table: key n of the sequence is
at block `table[row, n // BS]`, offset `n % BS`.  Scores are masked per row (causal, and the
layer's sliding window), soft-capped where the model says (Gemma 2), and kept in an online
softmax in fp32 (flash attention's recurrence).

Decode steps have one token per tile and often few tiles (batch 1 with 8 KV heads is 8 programs
on a GPU with 40-132 multiprocessors), so once a sequence holds more than a short context
(attention.short_context), while the programs do not fill the GPU, the keys are also split into
NSPLIT chunks, each a program of its own ("flash-decoding"), merged by their log-sum-exp in a
second small kernel.  (Merging in the last of a tile's programs instead, after an atomic count,
saved the kernel but not its time: on an H100 the attention kernel grew by what the merge kernel
had cost, the same chain of dependent loads now on its critical path; bench/RESULTS.md,
2026-12-06, midday.)

int8 caches hold a scale per position and KV head: keys are scaled in the scores, values through
the probabilities (p * scale before p @ v), so no dequantized copy is ever written.

Import only where Triton runs (a CUDA GPU).  Layouts: q [T, heads, D] with head h reading KV
head h // G; caches [blocks + 1, BS, kv_heads, D]; scales [blocks + 1, BS, kv_heads].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantserve.server.fastcore import dependent_launch
from quantserve.server.fastcore.attention import decode_tile, merge_in_one_round, short_context
from quantserve.server.fastcore.batch import prompt_tile
from quantserve.server.fastcore.blocks import BLOCK
from quantserve.server.fastcore.dependent_launch import wait_for_previous
from quantserve.server.fastcore.triton_dequant import TENSOR_CORE_DOT

# (keys a step, warps) of a program where Triton's tl.dot is tensor-core MMA (sm_80+): the decode tile
# measured since 2026-12-06 (bench/RESULTS.md; bench.attention_split --decode-tiles times others),
# the prompt tile (BLOCK_Q x G query rows; 8 warps past 64 rows).  Where tl.dot is FMAs (sm_75, a
# T4): _program_shape
DECODE_TILE = (64, 4)
PROMPT_TILE_N = 32


@triton.jit
def _rotated(ptr, row_off, cos_ptr, sin_ptr, t, d, ok, D: tl.constexpr):
    """One head's vector at ptr + row_off (+ d) turned by the rotary embedding of token t's row of
    cos / sin ([tokens, D]): x * cos + rotate_half(x) * sin, in fp32 (rotate_half: -x[d + D/2] in
    the first half, x[d - D/2] in the second); 0 where not `ok`.  row_off and ok broadcast against
    d: [rows, 1] or scalar."""
    d_ok = d < D
    x = tl.load(ptr + row_off + d, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(ptr + row_off + (d + D // 2) % D, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    return x * c + tl.where(d < D // 2, -partner, partner) * s


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
                      table_ptr, slot_ptr, pos_ptr, tiles_ptr, s_table, scale, softcap, window,
                      cos_ptr, sin_ptr, qkv_stride,
                      H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                      D: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                      TILE_N: tl.constexpr, BS: tl.constexpr, NSPLIT: tl.constexpr, INT8: tl.constexpr,
                      SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, FP32: tl.constexpr, NEW_KV: tl.constexpr,
                      ROW_PARTS: tl.constexpr = 1, PDL: tl.constexpr = False):
    wait_for_previous(PDL)  # everything it reads may come from the kernel before (dependent_launch.py)
    tile, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = tl.load(tiles_ptr + tile * 3)
    q0 = tl.load(tiles_ptr + tile * 3 + 1)
    nq = tl.load(tiles_ptr + tile * 3 + 2)
    row = tl.load(slot_ptr + seq).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    if ROW_PARTS > 1:  # a prompt tile's rows over ROW_PARTS programs (_program_shape); prompts split no keys
        r += split * BLOCK_M
        split = 0
    tok, g = r // GP, r % GP
    row_ok = (tok < nq) & (g < G)
    t = q0 + tok  # each row's token in the flat batch
    d = tl.arange(0, DP)
    d_ok = d < D
    head_off = ((t.to(tl.int64) * H + h * G + g) * D)[:, None] + d[None, :]
    qpos = tl.load(pos_ptr + t, mask=tok < nq, other=0)
    hi = tl.load(pos_ptr + q0 + nq - 1) + 1  # keys 0..hi-1 are the tile's to see
    if NEW_KV:  # a decode tile (one token) straight from wqkv's output, before the rotary embedding
        q_off = (q0.to(tl.int64) * qkv_stride + (h * G + g) * D)[:, None]
        # rows of padding heads (g >= G) read nothing: past the last head they would leave the row
        q = _rotated(q_ptr, q_off, cos_ptr, sin_ptr, q0, d[None, :], row_ok[:, None] & d_ok[None, :], D)
        q = q.to(k_ptr.dtype.element_ty)
        # this KV head's new key (turned) and value, rounded to the cache's dtype as the cache holds them
        new_off = q0.to(tl.int64) * qkv_stride + (H + h) * D
        k_new = _rotated(q_ptr, new_off, cos_ptr, sin_ptr, q0, d, d_ok, D).to(k_ptr.dtype.element_ty)
        v_new = tl.load(q_ptr + new_off + HKV * D + d, mask=d_ok, other=0.0).to(v_ptr.dtype.element_ty)
        # written by one program; no program reads this position from the cache in this call (below)
        if split == 0:
            at_new = ((tl.load(table_ptr + row * s_table + (hi - 1) // BS).to(tl.int64) * BS + (hi - 1) % BS) * HKV
                      + h) * D
            tl.store(k_ptr + at_new + d, k_new, mask=d_ok)
            tl.store(v_ptr + at_new + d, v_new, mask=d_ok)
    else:
        q = tl.load(q_ptr + head_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lo = 0
    if WINDOW:
        lo = tl.maximum(tl.load(pos_ptr + q0) - window + 1, 0)
    per = tl.cdiv(tl.cdiv(hi - lo, NSPLIT), TILE_N) * TILE_N
    start = lo + split * per
    end = tl.minimum(start + per, hi)
    cached = tl.minimum(end, hi - 1) if NEW_KV else end  # NEW_KV: the last key is k_new, not read
    m = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite: a chunk with no visible key stays NaN-free
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DP), tl.float32)
    for n0 in range(start, cached, TILE_N):
        n = n0 + tl.arange(0, TILE_N)
        n_ok = n < cached
        blk = tl.load(table_ptr + row * s_table + n // BS, mask=n_ok, other=0).to(tl.int64)
        at = (blk * BS + n % BS) * HKV + h  # the key's (position, kv head) in the cache
        kv_off = (at * D)[:, None] + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if INT8:
            k = k.to(q.dtype)
        if FP32:  # fp32 caches (tests): no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_M, TILE_N], fp32 accumulation
        s = s * scale
        if INT8:
            s = s * tl.load(ks_ptr + at, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:  # cap * tanh(s / cap), tanh from exp
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            s = softcap * tl.where(s >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
        visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
        if WINDOW:
            visible = visible & (n[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if INT8:
            v = v.to(q.dtype)
            p = p * tl.load(vs_ptr + at, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if NEW_KV:  # the new key, in the chunk that holds its position (always visible to its own token)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
        if SOFTCAP:
            e = tl.exp(-2.0 * tl.abs(s_new) / softcap)
            s_new = softcap * tl.where(s_new >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
        s_new = tl.where((start <= hi - 1) & (hi - 1 < end), s_new, float("-inf"))
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s_new - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
        m = m_new
    if NSPLIT == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + head_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (tile * HKV + h) * NSPLIT + split
        tl.store(acc_ptr + (part * BLOCK_M + r)[:, None] * DP + d[None, :], acc)
        tl.store(m_ptr + part * BLOCK_M + r, m)
        tl.store(l_ptr + part * BLOCK_M + r, l)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, tiles_ptr, pos_ptr, window,
                  H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NSPLIT: tl.constexpr,
                  WINDOW: tl.constexpr, PDL: tl.constexpr = False):
    """The chunks of keys of one (tile, KV head) that had keys to see, merged by their log-sum-exp,
    one chunk at a time (each load waits for the positions' loads, and each chunk's for the last)."""
    wait_for_previous(PDL)
    tile, h = tl.program_id(0), tl.program_id(1)
    q0 = tl.load(tiles_ptr + tile * 3 + 1)
    nq = tl.load(tiles_ptr + tile * 3 + 2)
    # only the chunks that had keys to see (the partial kernel's split of the same range)
    hi = tl.load(pos_ptr + q0 + nq - 1) + 1
    lo = 0
    if WINDOW:
        lo = tl.maximum(tl.load(pos_ptr + q0) - window + 1, 0)
    per = tl.cdiv(tl.cdiv(hi - lo, NSPLIT), TILE_N) * TILE_N
    active = tl.cdiv(hi - lo, per)
    r = tl.arange(0, BLOCK_M)
    tok, g = r // GP, r % GP
    d = tl.arange(0, DP)
    base = (tile * HKV + h) * NSPLIT
    m_all = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    for s in range(0, active):
        m_all = tl.maximum(m_all, tl.load(m_ptr + (base + s) * BLOCK_M + r))
    denom = tl.zeros((BLOCK_M,), tl.float32)
    out = tl.zeros((BLOCK_M, DP), tl.float32)
    for s in range(0, active):
        w = tl.exp(tl.load(m_ptr + (base + s) * BLOCK_M + r) - m_all)
        denom += tl.load(l_ptr + (base + s) * BLOCK_M + r) * w
        out += tl.load(acc_ptr + ((base + s) * BLOCK_M + r)[:, None] * DP + d[None, :]) * w[:, None]
    out = out / tl.where(denom > 0, denom, 1.0)[:, None]
    row_ok = (tok < nq) & (g < G)
    t = q0 + tok
    tl.store(out_ptr + ((t.to(tl.int64) * H + h * G + g) * D)[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _merge_round_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, tiles_ptr, H: tl.constexpr, HKV: tl.constexpr,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                        NSPLIT: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """The NSPLIT chunks of keys of one (tile, KV head) merged by their log-sum-exp, CHUNK of them
    held at once.  Every chunk is read, also those past the sequence's keys (the partial kernel
    stores m = -1e30, l = 0, acc = 0 for them: weight 0), so no address waits for a load: reading
    only the chunks that had keys put the tile's and its positions' loads, then each chunk's in
    turn, on one chain (_merge_kernel).  Opt-in until measured on a GPU (attention.merge_in_one_round:
    bench/attention_gpu.sh times it against _merge_kernel)."""
    wait_for_previous(PDL)
    tile, h = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DP)
    base = (tile * HKV + h) * NSPLIT
    m_all = tl.max(tl.load(m_ptr + (base + tl.arange(0, NSPLIT))[:, None] * BLOCK_M + r[None, :]), 0)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    out = tl.zeros((BLOCK_M, DP), tl.float32)
    for c in range(NSPLIT // CHUNK):  # one round but for the widest heads (_merge_shape)
        at = (base + c * CHUNK + tl.arange(0, CHUNK))[:, None] * BLOCK_M + r[None, :]  # [CHUNK, BLOCK_M]
        w = tl.exp(tl.load(m_ptr + at) - m_all[None, :])
        denom += tl.sum(tl.load(l_ptr + at) * w, 0)
        out += tl.sum(tl.load(acc_ptr + at[:, :, None] * DP + d[None, None, :]) * w[:, :, None], 0)
    out = out / tl.where(denom > 0, denom, 1.0)[:, None]
    q0 = tl.load(tiles_ptr + tile * 3 + 1)
    nq = tl.load(tiles_ptr + tile * 3 + 2)
    tok, g = r // GP, r % GP
    row_ok = (tok < nq) & (g < G)
    t = q0 + tok
    tl.store(out_ptr + ((t.to(tl.int64) * H + h * G + g) * D)[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d < D)[None, :])


def _splits(programs: int, sms: int, max_keys: int, short: int) -> int:
    """Key chunks per (tile, KV head) of a decode step: none within the short context (`short`
    keys, attention.short_context) or once the programs fill the GPU (at the 8B shape's batch 32
    on an H100, 256 programs on 132 multiprocessors, one program a sequence and KV head took
    0.66-0.81x the time of two chunks and their merge at 64-2,048 keys: bench.attention_split,
    bench/RESULTS.md 2026-12-06), else enough for two waves, at most 16 (the merge reads every
    chunk that had keys: 64 of them took 30 us a layer on the 1B shape).  short 0: always split
    (the rule before either exception)."""
    if short and (max_keys <= short or programs >= sms):
        return 1
    want = max(1, min(16, -(-2 * sms // max(programs, 1))))
    return 1 << (want - 1).bit_length()


def _merge_shape(nsplit: int, block_m: int, dp: int) -> tuple[int, int]:
    """(chunks of keys the merge holds at once, its warps): all of them where that is at most 32K
    fp32 partial sums (the 8B shape's 16 chunks x 16 rows x 128: one round on 16 warps), else 16K a
    round (wider heads: at 32K a round the rounds' loop spilled registers, sm_90), ~64 a thread."""
    chunk = nsplit if nsplit * block_m * dp <= 1 << 15 else max(1, (1 << 14) // (block_m * dp))
    return chunk, min(16, max(4, triton.next_power_of_2(chunk * block_m * dp // (32 * 64))))


def _program_shape(mma: bool, block_q: int, block_m: int, dp: int) -> tuple[int, int, int]:
    """(keys a step, warps, query rows) of one attention program, for tiles of block_q tokens
    (block_m = block_q x G rounded rows) and heads of dp (a power of two), where tl.dot is
    tensor-core MMA (`mma`: triton_dequant.TENSOR_CORE_DOT) or FMAs.

    Where tl.dot is FMAs (sm_75, a T4) the tensor-core tiles do not fit: compiled for sm_75 by
    Triton 3.6 (`cuobjdump -res-usage`, bench/RESULTS.md 2026-12-07), the decode tile of 64 keys on
    4 warps took 255 registers and 2.4 KB of local memory a thread at the 8B shape (head 128), the
    prompt tile (64 rows, 32 keys, 4 warps) 5 KB; at a head of 256 (Gemma) they need 80 and 96 KB
    of shared memory, past a T4's 64 KB, so they would not launch.  There: decodes 32 keys on 8
    warps (16 on 4 at a head of 256), prompts 16 keys on 8 warps, at a head of 256 in programs of
    32 rows (two a 64-row tile); none of them spills, all within 48 KB (`python -m
    quantserve.bench.sass --attention` shows it).  $QUANTSERVE_ATTENTION_DECODE_TILE
    (attention.decode_tile) sets the decode tile on any GPU."""
    if block_q == 1:
        keys, warps = decode_tile() or (DECODE_TILE if mma else (32, 8) if dp <= 128 else (16, 4))
        return keys, warps, block_m
    if mma:
        return PROMPT_TILE_N, 4 if block_m <= 64 else 8, block_m
    return 16, 8, min(block_m, 64 if dp <= 128 else 32)


def _sms(device: torch.device) -> int:
    """Multiprocessors the launcher plans for: the GPU's, or in Triton's interpreter (tests on a
    CPU) an H100's 132, so the interpreter takes the decisions the kernels are tuned on."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale, table, seq_slot, pos,
            tiles, block_q: int, scale: float, softcap: float, window: int, max_keys: int, H: int,
            rope=None) -> torch.Tensor:
    """The attention kernel (and the merge of split keys) over q [T, H, D], or, with rope = (cos,
    sin), over a decode step's wqkv output q [T, (H + 2 HKV) D] (NEW_KV) -> [T, H, D].  max_keys:
    the most keys one sequence holds after the step (or more): up to a short context, no split."""
    T = q.shape[0]
    HKV, D = k_cache.shape[2], k_cache.shape[3]
    G = H // HKV
    GP = triton.next_power_of_2(G)
    DP = triton.next_power_of_2(D)
    block_m = max(16, block_q * GP)  # tl.dot needs 16 rows
    NT = tiles.shape[0]
    q = q.contiguous()
    out = torch.empty((T, H, D), device=q.device, dtype=q.dtype)
    nsplit = _splits(NT * HKV, _sms(q.device), max_keys, short_context()) if block_q == 1 else 1
    tile_n, warps, rows = _program_shape(TENSOR_CORE_DOT, block_q, block_m, DP)
    if nsplit > 1:
        acc = torch.empty((NT * HKV * nsplit * block_m, DP), device=q.device, dtype=torch.float32)
        m = torch.empty((NT * HKV * nsplit * block_m,), device=q.device, dtype=torch.float32)
        l = torch.empty_like(m)
    else:
        acc = m = l = out  # not written
    int8 = k_scale is not None
    ks, vs = (k_scale, v_scale) if int8 else (k_cache, v_cache)  # placeholders, never read
    cos, sin = rope if rope is not None else (q, q)  # placeholders, never read
    parts = block_m // rows  # > 1 only for prompts (nsplit 1): program_id(2) picks the rows
    _attention_kernel[(NT, HKV, nsplit * parts)](
        q, k_cache, v_cache, ks, vs, out, acc, m, l, table, seq_slot, pos, tiles, table.stride(0), scale,
        softcap, window, cos.contiguous(), sin.contiguous(), q.stride(0), H=H, HKV=HKV, G=G, GP=GP, D=D, DP=DP,
        BLOCK_Q=block_q, BLOCK_M=rows, TILE_N=tile_n, BS=BLOCK, NSPLIT=nsplit, INT8=int8, SOFTCAP=softcap > 0,
        WINDOW=window > 0, FP32=q.dtype == torch.float32, NEW_KV=rope is not None, ROW_PARTS=parts,
        num_warps=warps, **dependent_launch.launch_options(_attention_kernel, q.device))
    if nsplit > 1 and merge_in_one_round():
        chunk, warps = _merge_shape(nsplit, block_m, DP)
        _merge_round_kernel[(NT, HKV)](acc, m, l, out, tiles, H=H, HKV=HKV, G=G, GP=GP, D=D, DP=DP, BLOCK_M=block_m,
                                        NSPLIT=nsplit, CHUNK=chunk, num_warps=warps,
                                        **dependent_launch.launch_options(_merge_round_kernel, q.device))
    elif nsplit > 1:
        _merge_kernel[(NT, HKV)](acc, m, l, out, tiles, pos, window, H=H, HKV=HKV, G=G, GP=GP, D=D, DP=DP,
                                  BLOCK_M=block_m, TILE_N=tile_n, NSPLIT=nsplit, WINDOW=window > 0, num_warps=4,
                                  **dependent_launch.launch_options(_merge_kernel, q.device))
    return out


@torch.library.custom_op("quantserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, table: torch.Tensor, seq_slot: torch.Tensor, pos: torch.Tensor,
                    tiles: torch.Tensor, block_q: int, scale: float, softcap: float, window: int,
                    max_keys: int) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; see the module's docstring for the other layouts.  block_q: the
    most tokens of a tile (1 for a decode-only batch); softcap 0 and window 0 mean none; max_keys:
    the most keys a sequence holds (at least)."""
    return _launch(q, k_cache, v_cache, k_scale, v_scale, table, seq_slot, pos, tiles, block_q, scale, softcap,
                   window, max_keys, q.shape[1])


@paged_attention.register_fake
def _(q, k_cache, v_cache, k_scale, v_scale, table, seq_slot, pos, tiles, block_q, scale, softcap, window, max_keys):
    return torch.empty_like(q)


@torch.library.custom_op("quantserve::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, table: torch.Tensor, seq_slot: torch.Tensor, pos: torch.Tensor,
                     tiles: torch.Tensor, heads: int, scale: float, softcap: float, window: int,
                     max_keys: int) -> torch.Tensor:
    """A decode step's attention from wqkv's output qkv [T, (heads + 2 kv heads) * D] (one token a
    tile), cos / sin [T, D] its tokens' rotary rows: q and the new key turned, the new key and value
    written to the (fp16 / fp32) caches, attention over the cache and the new key -> [T, heads, D]."""
    return _launch(qkv, k_cache, v_cache, None, None, table, seq_slot, pos, tiles, 1, scale, softcap, window,
                   max_keys, heads, (cos, sin))


@decode_attention.register_fake
def _(qkv, cos, sin, k_cache, v_cache, table, seq_slot, pos, tiles, heads, scale, softcap, window, max_keys):
    return qkv.new_empty((qkv.shape[0], heads, k_cache.shape[3]))


def _max_keys(batch) -> int:
    """The most keys a sequence of the batch holds after the step, from the kv_blocks size carrier
    (a true bound in decode steps: graphs.py records a graph per side of the short context)."""
    return batch.kv_blocks.shape[0] * BLOCK


def attend_triton(q: torch.Tensor, att, batch, table: torch.Tensor) -> torch.Tensor:
    """attention.py's contract, on the GPU."""
    a = att.a
    block_q = 1 if batch.q_cols.shape[0] == 1 else prompt_tile(a.n_heads // a.n_kv_heads)
    return paged_attention(q, att.k_cache, att.v_cache, att.k_scale, att.v_scale, table, batch.seq_slot,
                           batch.pos, batch.tiles, block_q, float(a.attn_scale or a.head_dim ** -0.5),
                           float(a.attn_softcap or 0.0), int(att.window or 0), _max_keys(batch))


def attend_new_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, att, batch,
                      table: torch.Tensor) -> torch.Tensor:
    """attention.py's decode contract (rotary and cache write inside), on the GPU."""
    a = att.a
    return decode_attention(qkv, cos, sin, att.k_cache, att.v_cache, table, batch.seq_slot, batch.pos, batch.tiles,
                            a.n_heads, float(a.attn_scale or a.head_dim ** -0.5), float(a.attn_softcap or 0.0),
                            int(att.window or 0), _max_keys(batch))
