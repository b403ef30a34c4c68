"""Weight-only int8 / int4 matrix-vector kernels for batch-1 decode: y[1, N] = x[1, K] @ dequant(W).T

At batch 1 the tiled kernels in `triton_mm.py` spend a 16-row `tl.dot` tile on one row of
activations; these kernels do no tensor-core work.  Each program owns BLOCK_N output rows and
walks the whole of K: no split-K, so no zero-filled fp32 buffer, no atomics and no cast kernel
after it (a linear layer is one kernel).

What makes them stream, against the version before (bench/RESULTS.md, 2026-12-03: 37-46 % of copy
bandwidth on the 8B model's small layers), each seen in the SASS Triton makes for sm_90:
- the weights are read as 4-byte words, one word per thread and row, the warps side by side along
  K (BLOCK_K = 128 * warps for int8, 256 * warps for int4).  x is read as one strided load per
  column of a word, which lands in the words' own register layout: the old kernel's x went
  through shared memory with three barriers on every tile;
- products are summed inside each thread; threads and warps are reduced once, after the loop;
- int8 -> fp16 and int4 -> fp16 by the bit tricks of FasterTransformer / Marlin in inline PTX
  (triton_dequant's `int8_quad`, `nibble_pair`: one prmt or lop3 per two columns), widened to fp32
  exactly, so a weight costs ~3.5 instructions instead of ~5 (BIT_DEQUANT=False: Triton's own
  conversion);
- rows past N read row N - 1 (clamped, unmasked loads) and are not stored;
- each step's weights are loaded a step ahead (LOAD_AHEAD).

int4 (group g): w = q * s + m with one (s, m) per row and group; a word's 8 columns lie inside one
group, so x . w = s * (x . q) + m * sum(x) per word.  Packing as in triton_mm: column 2j in the high
nibble of byte j, 2j + 1 in the low one.

At batch 1 the element-wise work around a layer costs more in launches than in bytes (a decode
step of the 8B shape ran ~190 inductor kernels of ~1.5 us beside its 129 weight kernels), so the
kernels can take it in (`quant.*.fused`, model.py's blocks through fused.py):
- NORM: x is RMS-normalized on the way in: each program walks all of K anyway, so it sums x^2
  beside the products and scales its rows' sums by rsqrt(mean + eps) once at the end (the qkv,
  gate-up and vocabulary layers, so no norm kernels); NORM_WEIGHT: x times the norm's weight as
  it is loaded (without it, the weight was folded into the layer's columns: fused.fold_norms);
- GATED: the weight's rows are [gate; up] and the output is silu(gate) * up, N / 2 wide (the
  gate-up layer).  A program takes BLOCK_N / 2 gate rows and the up rows that go with them,
  interleaved, and pairs them once after the loop; as a prologue of the down layer instead, the
  silu cost ~1 instruction a weight inside its loop (+27 % for int8 in the sm_90 SASS);
- RESIDUAL: the output row is added to `res` before the store (the o and down layers).

The signatures match the tiled kernels' (BLOCK_M is accepted and ignored; SPLIT_K > 1 stores
partial sums, for a caller that asks for it: the configs here keep 1), so one launcher serves both.
`triton_mm._launch` times these against the tiled kernels per layer shape at start-up and keeps
the faster.  Import only where Triton and a CUDA GPU exist (TRITON_INTERPRET=1 on a CPU runs the
same arithmetic without the PTX).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from quantserve.server.fastcore.dependent_launch import wait_for_previous
from quantserve.server.fastcore.triton_dequant import (AUTOTUNE_OPTIONS, PTX as _PTX, first_words, int8_quad,
                                                       nibble_pair, step_words)
from quantserve.server.fastcore.triton_dp4a import (activation as _activation, dot_int8, quantize4,
                                                    word_products)
from quantserve.server.fastcore.triton_splits import store_row

# (BLOCK_N, BLOCK_K, warps): one 4-byte word per thread and row, the warps side by side along K,
# so BLOCK_K = 128 * warps (int8: 4 columns a word) or 256 * warps (int4: 8 columns a word)
_INT8 = ((8, 512, 4), (16, 512, 4), (32, 512, 4), (4, 512, 4), (8, 1024, 8), (16, 1024, 8), (32, 1024, 8),
         (16, 256, 2))
_INT4 = ((8, 1024, 4), (16, 1024, 4), (32, 1024, 4), (4, 1024, 4), (8, 2048, 8), (16, 2048, 8), (16, 512, 2),
         (8, 256, 1))


# AHEAD: each K step's weight words are loaded one step before they are used, so a thread has the
# next step's loads in flight while it computes this one.  Triton pipelines no loads here
# (num_stages 1: its pipelining goes through shared memory), so without it every step waits a
# whole memory round trip, which a small layer's few programs (o: 256 of 16 rows) cannot hide.
# int4's scales and zero points (a few bytes a row, mostly cached) are loaded in their own step:
# carrying them too cost 75 instructions a K step of the dp4a form (sm_90 SASS), the words 30.
# On an H100 (bench/RESULTS.md, 2026-12-06): the 8B's int4 decode at batch 1 1.098x as fast (ahead,
# off, ahead in one call), int8 1.02x.  QUANTSERVE_GEMV_AHEAD=0 turns it off.
LOAD_AHEAD = os.environ.get("QUANTSERVE_GEMV_AHEAD", "1") != "0"


def _config(bn: int, bk: int, warps: int):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=warps, num_stages=1)


def _configs(shapes=None):
    """Every config of either kernel (each runs the other's too, only slower), or those of `shapes`."""
    return [_config(*c) for c in (shapes or dict.fromkeys(_INT8 + _INT4 + ((16, 128, 1),)))]


def _prune(configs, named_args, **kwargs):
    K = named_args["K"]
    return [c for c in configs if K % (c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"]) == 0]


def fits(tuned, K: int) -> bool:
    """Whether one of `tuned`'s configs covers K in whole blocks (its BLOCK_K is >= 256: a K such as
    896 or 1152 has none, and the launcher then keeps the tiled kernel at batch 1 too)."""
    return bool(_prune(tuned.configs, {"K": K}))


@triton.jit
def _rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """This program's weight rows, clamped to N - 1 (rows past N are read, never stored).  GATED:
    gate row j and up row j + N / 2 side by side, for j in this program's BLOCK_N / 2 outputs."""
    idx = tl.arange(0, BLOCK_N)
    if GATED:
        half = N // 2
        return tl.minimum(pid_n * (BLOCK_N // 2) + idx // 2, half - 1) + (idx % 2) * half
    return tl.minimum(pid_n * BLOCK_N + idx, N - 1)


@triton.jit
def _finish_row(out_ptr, y, pid_n, N, K, sq, eps, res_ptr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                GATED: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr):
    """The rows' sums y (fp32, [BLOCK_N]) scaled by the norm's rsqrt(mean(x^2) + eps), paired into
    silu(gate) * up, added to the residual, as the flags say, then stored."""
    if NORM:
        y = y * tl.rsqrt(tl.sum(sq) / K + eps)
    if GATED:  # rows 2j and 2j + 1 are gate j and up j (_rows)
        gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
        y = gate * tl.sigmoid(gate) * up
        rn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        n_out = N // 2
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_out = N
    if RESIDUAL:
        y += tl.load(res_ptr + rn, mask=rn < n_out, other=0.0).to(tl.float32)
    store_row(out_ptr, y, rn, n_out, SPLIT_K)


@triton.jit(do_not_specialize_on_alignment=["K"])
def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      BIT_DEQUANT: tl.constexpr = True, norm_ptr=None, res_ptr=None, eps=0.0,
                      NORM: tl.constexpr = False, GATED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                      DOT4: tl.constexpr = False, AHEAD: tl.constexpr = LOAD_AHEAD,
                      NORM_WEIGHT: tl.constexpr = False, PDL: tl.constexpr = False):
    # The int8 weights are read as int32 words of 4 columns, one word per thread and row (K is
    # not specialised on 16, so the loads stay one word wide); column c of x for each word is a
    # strided load of its own, one per thread, shared by the thread's rows, in the words' layout.
    # With BIT_DEQUANT the words become 1152 + b (see int8_quad): each thread sums
    # (1152 + b) x over its own columns and takes 1152 * (its sum of x) off before the threads'
    # sums meet, so the offset costs nothing in the loop.  Otherwise: sign-extending shifts and
    # Triton's int -> float conversion.
    W: tl.constexpr = BLOCK_K // 4
    pid_n = tl.program_id(0)
    rows = _rows(pid_n, N, BLOCK_N, GATED)
    rw = tl.arange(0, W)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 4) + rw[None, :]
    k_len = K // SPLIT_K  # this program's [k0, k0 + k_len) of K: all of it without split-K
    k0 = tl.multiple_of(tl.program_id(1) * k_len, BLOCK_K) if SPLIT_K > 1 else 0
    acc = tl.zeros((BLOCK_N, W), dtype=tl.float32)
    xacc = tl.zeros((W,), dtype=tl.float32)
    sq = tl.zeros((W,), dtype=tl.float32)
    ahead = first_words(w_ptrs, k0, 4, AHEAD)
    wait_for_previous(PDL)  # x and the outputs only once the kernel before has finished (dependent_launch.py)
    for k in range(k0, k0 + k_len, BLOCK_K):
        k = tl.multiple_of(k, BLOCK_K)
        words, ahead = step_words(w_ptrs, k, k0 + k_len, ahead, BLOCK_K, 4, AHEAD)  # [BN, W] int32
        x0, sq0 = _activation(x_ptr, norm_ptr, k + 4 * rw, NORM_WEIGHT)
        x1, sq1 = _activation(x_ptr, norm_ptr, k + 4 * rw + 1, NORM_WEIGHT)
        x2, sq2 = _activation(x_ptr, norm_ptr, k + 4 * rw + 2, NORM_WEIGHT)
        x3, sq3 = _activation(x_ptr, norm_ptr, k + 4 * rw + 3, NORM_WEIGHT)
        if NORM:
            sq += (sq0 + sq1) + (sq2 + sq3)
        if DOT4:  # x rounded to int8, the word's 4 products in one dp4a (triton_dp4a.py)
            xq, xs = quantize4(x0, x1, x2, x3)
            acc += dot_int8(words, tl.broadcast_to(xq[None, :], (BLOCK_N, W))) * xs[None, :]
        else:
            if BIT_DEQUANT:
                w0, w1, w2, w3 = int8_quad(words)
                xacc += (x0 + x1) + (x2 + x3)
            else:
                w0 = ((words << 24) >> 24).to(tl.float32)
                w1 = ((words << 16) >> 24).to(tl.float32)
                w2 = ((words << 8) >> 24).to(tl.float32)
                w3 = (words >> 24).to(tl.float32)
            acc += w0 * x0[None, :]
            acc += w1 * x1[None, :]
            acc += w2 * x2[None, :]
            acc += w3 * x3[None, :]
    if BIT_DEQUANT and not DOT4:
        acc -= 1152.0 * xacc[None, :]
    scale = tl.load(s_ptr + rows).to(tl.float32)
    _finish_row(out_ptr, tl.sum(acc, axis=1) * scale, pid_n, N, K, sq, eps, res_ptr, BLOCK_N, NORM, GATED, RESIDUAL,
                SPLIT_K)


# x goes into the packed fp16 products scaled by 2^-6: a lane sums 4 products of q <= 15, so
# unscaled it would overflow fp16 (65504) for |x| > ~1,090, which outlier channels reach; scaled,
# only past fp16's own range.  The scale is exact (a power of two) and is taken back in fp32.
HALF_DOT_SCALE = tl.constexpr(1.0 / 64)


@triton.jit
def _x_pair(x_ptr, norm_ptr, k, rw, p: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
            NORM_WEIGHT: tl.constexpr):
    """Nibble pair p's activations (the columns of bits 4p and 16 + 4p: 2 (p // 2) + 1 - p % 2 and
    4 more): both scaled into fp16 and broadcast over the rows (_nibble_dot's inputs), their sum
    in fp32 (the zero points' term), and their squares' sum (the norm's statistics)."""
    x_lo, sq_lo = _activation(x_ptr, norm_ptr, k + 8 * rw + (2 * (p // 2) + 1 - p % 2), NORM_WEIGHT)
    x_hi, sq_hi = _activation(x_ptr, norm_ptr, k + 8 * rw + (2 * (p // 2) + 5 - p % 2), NORM_WEIGHT)
    a = tl.broadcast_to((x_lo * HALF_DOT_SCALE).to(tl.float16)[:, None], (W, BLOCK_N))
    b = tl.broadcast_to((x_hi * HALF_DOT_SCALE).to(tl.float16)[:, None], (W, BLOCK_N))
    return a, b, x_lo + x_hi, sq_lo + sq_hi


@triton.jit
def _nibble_dot(words, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum_j q_j * x_j over a word's 8 nibbles, in fp32 from packed fp16 math: x0..x7 are the
    (scaled) fp16 activations of the columns of bits 0, 16, 4, 20, 8, 24, 12, 28 (pair p: bits 4p
    and 16 + 4p).  Per word: 3 shifts and 4 lop3 make 1024 + q in both halves (Marlin's trick),
    4 sub.f16x2 take 1024 off exactly, 4 HFMA2 multiply-add both lanes, one add joins them in
    fp32.  With the loads, addresses and scales, a K step of 16 rows x 1,024 columns is 484
    instructions against 572 for fp32 products (sm_90 SASS, `bench sass --gemv-forms`).  Each
    product and each lane's sum of 4 is rounded to fp16: ~1e-3 of the output's scale."""
    if _PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 q0, q1, q2, q3, t, m, xp0, xp1, xp2, xp3, acc;
            .reg .b16 lo, hi;
            .reg .f32 flo, fhi;
            mov.b32 m, 0x64006400;
            mov.b32 xp0, {$2, $3};
            mov.b32 xp1, {$4, $5};
            mov.b32 xp2, {$6, $7};
            mov.b32 xp3, {$8, $9};
            lop3.b32 q0, $1, 0x000F000F, 0x64006400, 0xEA;
            shr.u32 t, $1, 4;
            lop3.b32 q1, t, 0x000F000F, 0x64006400, 0xEA;
            shr.u32 t, $1, 8;
            lop3.b32 q2, t, 0x000F000F, 0x64006400, 0xEA;
            shr.u32 t, $1, 12;
            lop3.b32 q3, t, 0x000F000F, 0x64006400, 0xEA;
            sub.f16x2 q0, q0, m;
            sub.f16x2 q1, q1, m;
            sub.f16x2 q2, q2, m;
            sub.f16x2 q3, q3, m;
            mul.rn.f16x2 acc, q0, xp0;
            fma.rn.f16x2 acc, q1, xp1, acc;
            fma.rn.f16x2 acc, q2, xp2, acc;
            fma.rn.f16x2 acc, q3, xp3, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.f16 flo, lo;
            cvt.f32.f16 fhi, hi;
            add.f32 $0, flo, fhi;
            }""",
            constraints="=r,r,h,h,h,h,h,h,h,h", args=[words, x0, x1, x2, x3, x4, x5, x6, x7], dtype=tl.float32,
            is_pure=True, pack=1)
    else:  # the same products and lane sums in fp16, for the interpreter
        lo = ((words & 0xF).to(tl.float16) * x0)
        hi = (((words >> 16) & 0xF).to(tl.float16) * x1)
        lo = lo + ((words >> 4) & 0xF).to(tl.float16) * x2
        hi = hi + ((words >> 20) & 0xF).to(tl.float16) * x3
        lo = lo + ((words >> 8) & 0xF).to(tl.float16) * x4
        hi = hi + ((words >> 24) & 0xF).to(tl.float16) * x5
        lo = lo + ((words >> 12) & 0xF).to(tl.float16) * x6
        hi = hi + ((words >> 28) & 0xF).to(tl.float16) * x7
        return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit(do_not_specialize_on_alignment=["K"])
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, BIT_DEQUANT: tl.constexpr = True, norm_ptr=None, res_ptr=None,
                      eps=0.0, NORM: tl.constexpr = False, GATED: tl.constexpr = False,
                      RESIDUAL: tl.constexpr = False, HALF_DOT: tl.constexpr = False, DOT4: tl.constexpr = False,
                      AHEAD: tl.constexpr = LOAD_AHEAD, NORM_WEIGHT: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    # The packed bytes are read as int32 words of 8 columns, one word per thread and row: byte i
    # of a word holds columns 2i (high nibble) and 2i + 1 (low), so column j of the word sits at
    # bit 8 * (j // 2) + 4 * (1 - j % 2).  Column j of x for each word is a strided load of its
    # own, one per thread, shared by the thread's rows.  A word's 8 columns lie inside one group
    # (GROUP % 8 == 0), so its partial sum is scaled once.  Tiles are [words, rows] (K first):
    # then the scales' and the words' loads get the same register layout, and nothing in the loop
    # is exchanged through shared memory.
    W: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    rows = _rows(pid_n, N, BLOCK_N, GATED)
    k_len = K // SPLIT_K
    k0 = tl.multiple_of(tl.program_id(1) * k_len, BLOCK_K) if SPLIT_K > 1 else 0
    rw = tl.arange(0, W)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + rw[:, None] + rows[None, :] * (K // 8)
    sz_off = (8 * rw[:, None]) // GROUP + rows[None, :] * (K // GROUP)
    acc = tl.zeros((W, BLOCK_N), dtype=tl.float32)
    sq = tl.zeros((W,), dtype=tl.float32)
    ahead = first_words(w_ptrs, k0, 8, AHEAD)
    wait_for_previous(PDL)
    for k in range(k0, k0 + k_len, BLOCK_K):
        k = tl.multiple_of(k, BLOCK_K)
        words, ahead = step_words(w_ptrs, k, k0 + k_len, ahead, BLOCK_K, 8, AHEAD)  # [W, BN] int32
        s = tl.load(s_ptr + sz_off + k // GROUP).to(tl.float32)
        z = tl.load(z_ptr + sz_off + k // GROUP).to(tl.float32)
        part = tl.zeros((W, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((W,), dtype=tl.float32)
        if DOT4:  # x rounded to int8, the word's 8 products in two dp4a (triton_dp4a.py)
            # the zero points' term from the rounded x too: the error is then sum w (x̂ - x) with w
            # centred, not sum q s (x̂ - x) with q in [0, 15] (~half the error, bench/RESULTS.md)
            part, x_sum, x_sq = word_products(words, x_ptr, norm_ptr, k + 8 * rw, NORM_WEIGHT)
            xsum += x_sum
            if NORM:
                sq += x_sq
        elif HALF_DOT:  # the products in packed fp16 (_nibble_dot), x scaled down for them
            a0, b0, s0, sq0 = _x_pair(x_ptr, norm_ptr, k, rw, 0, W, BLOCK_N, NORM_WEIGHT)
            a1, b1, s1, sq1 = _x_pair(x_ptr, norm_ptr, k, rw, 1, W, BLOCK_N, NORM_WEIGHT)
            a2, b2, s2, sq2 = _x_pair(x_ptr, norm_ptr, k, rw, 2, W, BLOCK_N, NORM_WEIGHT)
            a3, b3, s3, sq3 = _x_pair(x_ptr, norm_ptr, k, rw, 3, W, BLOCK_N, NORM_WEIGHT)
            # both terms in x's scaled units (the sum once per column, not per row): the scale
            # comes off once, after the loop
            part = _nibble_dot(words, a0, b0, a1, b1, a2, b2, a3, b3)
            xsum += ((s0 + s1) + (s2 + s3)) * HALF_DOT_SCALE
            if NORM:
                sq += (sq0 + sq1) + (sq2 + sq3)
        elif BIT_DEQUANT:
            # two nibbles at once: (w >> 4p) & 0x000F000F | 0x64006400 holds 1024 + q of two
            # columns as fp16 halves (Marlin's trick), widened to fp32 in one asm block;
            # sum (1024 + q) x = sum q x + 1024 sum x in fp32 keeps ~14 bits of q x, and the
            # 1024 sum x comes off with the offset below
            for p in tl.static_range(4):
                # the columns of bits 4p and 16 + 4p: 2 (p // 2) + 1 - p % 2 and 4 more
                x_lo, sq_lo = _activation(x_ptr, norm_ptr, k + 8 * rw + (2 * (p // 2) + 1 - p % 2), NORM_WEIGHT)
                x_hi, sq_hi = _activation(x_ptr, norm_ptr, k + 8 * rw + (2 * (p // 2) + 5 - p % 2), NORM_WEIGHT)
                q_lo, q_hi = nibble_pair(words, 4 * p)
                part += q_lo * x_lo[:, None]
                part += q_hi * x_hi[:, None]
                xsum += x_lo + x_hi
                if NORM:
                    sq += sq_lo + sq_hi
            z = z - 1024.0 * s
        else:
            for j in tl.static_range(8):
                xj, sqj = _activation(x_ptr, norm_ptr, k + 8 * rw + j, NORM_WEIGHT)
                part += ((words >> (8 * (j // 2) + 4 * (1 - j % 2))) & 0xF).to(tl.float32) * xj[:, None]
                xsum += xj
                if NORM:
                    sq += sqj
        acc += part * s  # two statements: two fused multiply-adds (one expression was FMUL, FFMA, FADD)
        acc += xsum[:, None] * z
    y = tl.sum(acc, axis=0)
    if HALF_DOT:
        y = y * (1.0 / HALF_DOT_SCALE)
    _finish_row(out_ptr, y, pid_n, N, K, sq, eps, res_ptr, BLOCK_N, NORM, GATED, RESIDUAL, SPLIT_K)


def _tuned(kernel, shapes):
    return triton.autotune(configs=_configs(shapes), key=["N", "K"], prune_configs_by={"early_config_prune": _prune},
                           **AUTOTUNE_OPTIONS)(kernel)


int8_gemv_kernel, int4_gemv_kernel = _tuned(_int8_gemv_kernel, _INT8), _tuned(_int4_gemv_kernel, _INT4)
