"""Integer dot products for the batch-1 matrix-vector kernels: x rounded to int8, then 4 products a
instruction (`dp4a`), the way llama.cpp's matrix-vector kernels multiply its quantized weights.

Why: at batch 1 the int4 kernel is bound by instructions, not bytes (bench/RESULTS.md: 36-64 % of
copy bandwidth on the 8B layers).  Turning each weight into a float costs ~3.5-4.5 instructions a
weight in the SASS (a conversion and a fused multiply-add each, plus the unpacking); `dp4a`
multiplies 4 bytes by 4 bytes and adds them into an int32 in one instruction, so a word of 8
nibbles costs a shift, two masks and two `dp4a`, and one float conversion for all 8.

x is rounded to int8 by each thread for its own columns (the 4 or 8 columns of its weight word),
with one fp32 scale for those columns: no exchange between threads, and a finer grid than
llama.cpp's one scale per 32 columns.  The rounding is the kernels' only new error: |x - x̂| ≤
scale / 2 = max|x| / 254 over the word's columns.  The products are exact in int32 (|sum| ≤
8 · 15 · 127 for int4, 4 · 127 · 127 for int8, both < 2^22).

Both steps are bit tricks in fp32: v · (127 / max|x|) + 1.5 · 2^23 rounds v to the nearest integer
and leaves it in the float's low bits (two's complement in the low byte), and an int32 sum s < 2^22
added to the bits of 1.5 · 2^23 is that float plus s, so one subtraction gives float(s) without a
conversion instruction (which runs at 1/8 of the fused multiply-add's rate on sm_80 / sm_90).

int4's zero-point term (m · Σx per word) is taken from the rounded x too, so the error is
Σ w (x̂ - x) with w centred, not Σ q s (x̂ - x) with q in [0, 15]: half the error.

Measured on an H100 (bench/RESULTS.md, 2026-12-05): int4's weight kernels of an 8B decode step in
0.93× the float form's time; int8 gains nothing (it already streams at 63-84 % of copy bandwidth).
The launcher (triton_mm.py) times this form beside the float ones at batch 1 and keeps whichever
is fastest per layer shape; `QUANTSERVE_INT8_ACTIVATIONS=0` leaves it out (and ignores kept
choices that use it), for x exactly as the float kernels take it.  Quality on the default model
(CPU, x rounded as here before each layer; bench/RESULTS.md): top-1 agreement and perplexity
change within noise of the float kernels'.  Under Triton's interpreter (CPU tests) the same
integer arithmetic runs in Triton ops.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import PTX as _PTX

FLAG = "DOT4"  # the kernels' parameter for this form


def enabled() -> bool:
    """Whether the launcher may choose x rounded to int8 (on unless QUANTSERVE_INT8_ACTIVATIONS=0)."""
    return os.environ.get("QUANTSERVE_INT8_ACTIVATIONS", "1") != "0"


# (rows, columns, warps) of each kernel's configs that the shipped tables' dp4a rows keep (H100, H200):
# timed for this form whatever the float forms chose (triton_mm._launch)
PROVEN = {"_int8_gemv_kernel": ((8, 512, 4), (8, 1024, 8), (4, 512, 4)),
          "_int4_gemv_kernel": ((4, 1024, 4), (8, 1024, 4))}


def configs_to_time(gemv, config, K: int) -> list:
    """The configs the launcher times this form at: the float forms' choice; where the kernel's list
    has it, the same with twice the rows (a thread rounds its x once a step for all its rows, so
    more rows spread that cost; the float forms' timing does not see it); and the PROVEN ones that
    fit K.  Why the PROVEN ones: with only the first two, this form's speed hung on the float forms'
    autotuner.  In one of two fresh starts on an H100 that autotuner chose 16 rows x 512 columns on 2
    warps for the 8B's int4 down layer; this form, timed there only, lost to the float form, and the
    step ran at 296-299 tok/s against 357 with every layer in this form at 4 rows x 1,024 columns.
    Timed at its proven configs too, fresh starts kept it on every layer (358.6 and 357.4 tok/s;
    bench/RESULTS.md, 2026-12-07)."""
    def shape(c):
        return c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps

    wider = [c for c in gemv.configs if c.num_warps == config.num_warps
             and c.kwargs == {**config.kwargs, "BLOCK_N": 2 * config.kwargs["BLOCK_N"]}]
    out = [config] + wider[:1]
    taken = {shape(c) for c in out}
    return out + [c for c in gemv.configs if shape(c) in PROVEN.get(gemv.fn.__name__, ()) and shape(c) not in taken
                  and K % c.kwargs["BLOCK_K"] == 0]  # whole K blocks, as the autotuner prunes (triton_gemv._prune)


ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23 (bits 0x4B400000): float + it rounds to an integer


@triton.jit
def _byte(v, inv):
    """round(v * inv) in the low byte of an int32 (two's complement, |v * inv| <= 127)."""
    return (v * inv + ROUNDER).to(tl.int32, bitcast=True) & 0xFF


@triton.jit
def _pack(b0, b1, b2, b3):
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _inverse_and_scale(amax):
    amax = tl.maximum(amax, 1e-30)  # all-zero columns round to 0, not 0 * inf
    return 127.0 / amax, amax * (1.0 / 127.0)


@triton.jit
def quantize4(x0, x1, x2, x3):
    """4 columns of x (fp32) -> (their int8 values packed in an int32, byte i = column i; the scale)."""
    amax = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    inv, scale = _inverse_and_scale(amax)
    return _pack(_byte(x0, inv), _byte(x1, inv), _byte(x2, inv), _byte(x3, inv)), scale


@triton.jit
def quantize8_for_nibbles(x0, x1, x2, x3, x4, x5, x6, x7):
    """8 columns of x -> (int8 of columns 1, 3, 5, 7 packed; of columns 0, 2, 4, 6; the scale): the
    order of an int4 word's low nibbles and of its high ones (byte i holds column 2i high, 2i + 1 low)."""
    amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                      tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    inv, scale = _inverse_and_scale(amax)
    low = _pack(_byte(x1, inv), _byte(x3, inv), _byte(x5, inv), _byte(x7, inv))
    high = _pack(_byte(x0, inv), _byte(x2, inv), _byte(x4, inv), _byte(x6, inv))
    return low, high, scale


@triton.jit
def _signed_byte(v, i: tl.constexpr):
    return (v << (24 - 8 * i)) >> 24


@triton.jit
def dot_int8(words, xq):
    """sum_i w_i * x_i over the 4 signed bytes of each int32 word and of xq, as fp32."""
    if _PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 d;
            mov.b32 d, 0x4B400000;
            dp4a.s32.s32 d, $1, $2, d;
            sub.f32 $0, d, 0f4B400000;
            }""",
            constraints="=r,r,r", args=[words, xq], dtype=tl.float32, is_pure=True, pack=1)
    else:
        acc = _signed_byte(words, 0) * _signed_byte(xq, 0)
        for i in tl.static_range(1, 4):
            acc += _signed_byte(words, i) * _signed_byte(xq, i)
        return acc.to(tl.float32)


@triton.jit
def dot_int4(words, low, high):
    """sum_j q_j * x_j over an int32 word's 8 nibbles (unsigned) against the int8 columns `low`
    and `high` (quantize8_for_nibbles), as fp32."""
    if _PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, d;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            mov.b32 d, 0x4B400000;
            dp4a.u32.s32 d, lo, $2, d;
            dp4a.u32.s32 d, hi, $3, d;
            sub.f32 $0, d, 0f4B400000;
            }""",
            constraints="=r,r,r,r", args=[words, low, high], dtype=tl.float32, is_pure=True, pack=1)
    else:
        acc = ((words >> 0) & 0xF) * _signed_byte(low, 0) + ((words >> 4) & 0xF) * _signed_byte(high, 0)
        for i in tl.static_range(1, 4):
            acc += ((words >> (8 * i)) & 0xF) * _signed_byte(low, i)
            acc += ((words >> (8 * i + 4)) & 0xF) * _signed_byte(high, i)
        return acc.to(tl.float32)


@triton.jit
def column_sum(low, high):
    """The sum of the 8 int8 values packed in `low` and `high` (quantize8_for_nibbles), as fp32: a
    dp4a of each against bytes of 1."""
    ones = tl.full(low.shape, 0x01010101, tl.int32)
    return dot_int8(ones, low) + dot_int8(ones, high)


@triton.jit
def activation(x_ptr, norm_ptr, cols, NORM_WEIGHT: tl.constexpr):
    """x's columns `cols` in fp32, times the norm's weight with NORM_WEIGHT, and their squares
    before that weight (the norm's statistics; unused without NORM, so compiled away): how every
    batch-1 kernel form (triton_gemv.py) loads x."""
    x = tl.load(x_ptr + cols).to(tl.float32)
    sq = x * x
    if NORM_WEIGHT:
        x = x * tl.load(norm_ptr + cols).to(tl.float32)
    return x, sq


@triton.jit
def word_products(words, x_ptr, norm_ptr, cols, NORM_WEIGHT: tl.constexpr):
    """int4 words ([columns, rows] int32, one a row) against x's 8 columns from `cols` ([columns]),
    x rounded to int8 per word: (the products scaled by x's rounding scale, the rounded columns'
    sum, the squares' sum before the norm's weight)."""
    x0, q0 = activation(x_ptr, norm_ptr, cols, NORM_WEIGHT)
    x1, q1 = activation(x_ptr, norm_ptr, cols + 1, NORM_WEIGHT)
    x2, q2 = activation(x_ptr, norm_ptr, cols + 2, NORM_WEIGHT)
    x3, q3 = activation(x_ptr, norm_ptr, cols + 3, NORM_WEIGHT)
    x4, q4 = activation(x_ptr, norm_ptr, cols + 4, NORM_WEIGHT)
    x5, q5 = activation(x_ptr, norm_ptr, cols + 5, NORM_WEIGHT)
    x6, q6 = activation(x_ptr, norm_ptr, cols + 6, NORM_WEIGHT)
    x7, q7 = activation(x_ptr, norm_ptr, cols + 7, NORM_WEIGHT)
    low, high, xs = quantize8_for_nibbles(x0, x1, x2, x3, x4, x5, x6, x7)
    part = dot_int4(words, tl.broadcast_to(low[:, None], words.shape),
                    tl.broadcast_to(high[:, None], words.shape)) * xs[:, None]
    return part, column_sum(low, high) * xs, ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))
