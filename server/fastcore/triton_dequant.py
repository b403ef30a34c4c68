"""Exact int8 / int4 -> float in registers with integer ops, for the weight-only kernels.

A decode kernel converts every weight it streams, and a GPU's int -> float conversion runs at a
fraction of its arithmetic rate (16 results per clock per multiprocessor on sm_80/sm_90, against
128 fp32 FMAs).  A float whose exponent makes the mantissa's last bit worth 1 (fp16: 1024.0,
bits 0x6400; fp32: 2**23, bits 0x4B000000) turns an integer added into its bits into that float
plus the integer, so an integer add and one float subtraction give the exact value (the trick
FasterTransformer and Marlin use).

The tiled kernels (triton_mm.py) use these (`nibbles_to_fp16`: four packed bytes at a time in
inline PTX); BIT_DEQUANT=False keeps Triton's plain `.to()` conversion.  The batch-1 and few-rows
kernels (triton_gemv.py, triton_rows.py) do the same trick on int32 words (`int8_quad`,
`nibble_pair`: two columns per prmt or lop3, widened to fp32); the batch-1 kernels load their
words a step ahead or not (`first_words`, `step_words`).  Last, `dequantize_int8` / `dequantize_int4`: the whole
weight to fp16 in one pass, for prompts through cuBLAS.  Also here, what every weight kernel's tuning shares: the autotuners'
options (their timer: kernel_timing.py) and `compiling_ahead` (candidates compiled on threads).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from quantserve.server.fastcore.kernel_timing import quick_bench

# the interpreter (TRITON_INTERPRET=1, CPU checks) runs no PTX: the same arithmetic in Triton ops there
PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# Whether Triton's `tl.dot` runs on tensor cores on this GPU: it lowers to FMAs below sm_80 (a T4
# is sm_75), so work moved onto `tl.dot` is free only from sm_80 on, and tiles sized for tensor
# cores can spill there.  (The interpreter: as on sm_80+.)
TENSOR_CORE_DOT = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 0)


# The autotuners' options, where this Triton has them: the quick timer, and the choices kept on
# disk with the compiled kernels (compile_cache.py), so that a warm start times no configs at all.
_AUTOTUNE_PARAMETERS = inspect.signature(triton.autotune).parameters
AUTOTUNE_OPTIONS = ({"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMETERS else {}) | (
    {"do_bench": quick_bench} if "do_bench" in _AUTOTUNE_PARAMETERS else {})


def compiling_ahead():
    """A context in which Triton kernels asked for with `.warmup` compile on threads, all of them
    done when it exits.  A Triton compile takes ~0.2-3 s, most of it in LLVM and ptxas, which run
    outside the GIL (8 configs of the int8 kernel for sm_90: 6.6 s one by one, 3.5 s on 2 threads);
    a cold start compiles dozens (an 8B cold start's tuning: 23 s before, 14 s with this).  Kernels
    found in Triton's disk cache load in milliseconds either way.  A config that fails to compile
    is left to its first real call, which compiles it again and reports (or skips) it as before.
    Where Triton cannot compile ahead (no AsyncCompileMode before 3.4), nothing happens here."""
    mode = getattr(triton, "AsyncCompileMode", None)
    if mode is None or _compile_threads() < 2:
        return contextlib.nullcontext()
    return mode(_compile_pool(), ignore_errors=True)


@functools.cache
def _compile_threads() -> int:
    return min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@functools.cache
def _compile_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(_compile_threads(), thread_name_prefix="triton-compile")


@triton.jit
def int8_to(w, dtype: tl.constexpr, BIT_DEQUANT: tl.constexpr):
    """int8 tile -> `dtype` (-128..127 exactly)."""
    if BIT_DEQUANT:
        if dtype == tl.float32:
            bits = w.to(tl.int32) + 0x4B000080  # 2**23 + 128 + w
            out = bits.to(tl.float32, bitcast=True) - 8388736.0
        else:
            bits = (w.to(tl.int16) + 0x6480).to(tl.int16)  # 1024 + 128 + w as fp16
            out = (bits.to(tl.float16, bitcast=True) - 1152.0).to(dtype)
    else:
        out = w.to(dtype)
    return out


@triton.jit
def int8_pairs_to_fp16(w):
    """int16 tile, each value two int8 columns (2j in the low byte, 2j + 1 in the high one) -> the
    even and the odd columns as two fp16 tiles of its shape (int4's nibbles_to_fp16 for bytes).

    In PTX, four bytes at a time: xor 0x80 makes each byte 128 + w, prmt puts it under 0x64 (the
    fp16 1024 + 128 + w; bytes 0, 2 for the even columns, 1, 3 for the odd), sub.f16x2 takes 1152
    off exactly.  Five instructions for four weights.  In the interpreter: shifts."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 u, e, o, k1152;
            mov.b32 k1152, 0x64806480;
            xor.b32 u, $2, 0x80808080;
            prmt.b32 e, u, 0x64646464, 0x5240;
            prmt.b32 o, u, 0x64646464, 0x5341;
            sub.f16x2 $0, e, k1152;
            sub.f16x2 $1, o, k1152;
            }""",
            constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        v = w.to(tl.int32)
        return ((v << 24) >> 24).to(tl.float16), (v >> 8).to(tl.float16)


@triton.jit
def nibble_to(q, dtype: tl.constexpr, BIT_DEQUANT: tl.constexpr):
    """uint8 tile of values 0..15 -> `dtype`."""
    if BIT_DEQUANT:
        if dtype == tl.float32:
            bits = q.to(tl.int32) | 0x4B000000  # 2**23 + q
            out = bits.to(tl.float32, bitcast=True) - 8388608.0
        else:
            bits = (q.to(tl.int16) | 0x6400).to(tl.int16)  # 1024 + q as fp16
            out = (bits.to(tl.float16, bitcast=True) - 1024.0).to(dtype)
    else:
        out = q.to(dtype)
    return out


@triton.jit
def nibbles_to_fp16(packed, BIT_DEQUANT: tl.constexpr):
    """uint8 tile of packed nibbles -> (high nibbles, low nibbles) as two fp16 tiles of its shape.

    With BIT_DEQUANT, in PTX four bytes at a time (Marlin's trick on fp16 pairs): prmt spreads two
    bytes into the 16-bit halves of a word; lop3 puts a nibble under 0x6400 (the fp16 1024 + q,
    or 1024 + 16 q for the high one); sub.f16x2 / fma.f16x2 take the offset off exactly.  Ten
    instructions for eight weights, against ~five a weight through Triton's own integer ops."""
    if BIT_DEQUANT and PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t01, t23, h01, h23, l01, l23, sixteenth, minus64, k1024;
            mov.b32 sixteenth, 0x2C002C00;
            mov.b32 minus64, 0xD400D400;
            mov.b32 k1024, 0x64006400;
            prmt.b32 t01, $4, 0, 0x4140;
            prmt.b32 t23, $4, 0, 0x4342;
            lop3.b32 h01, t01, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 h23, t23, 0x00F000F0, 0x64006400, 0xEA;
            lop3.b32 l01, t01, 0x000F000F, 0x64006400, 0xEA;
            lop3.b32 l23, t23, 0x000F000F, 0x64006400, 0xEA;
            fma.rn.f16x2 $0, h01, sixteenth, minus64;
            fma.rn.f16x2 $1, h23, sixteenth, minus64;
            sub.f16x2 $2, l01, k1024;
            sub.f16x2 $3, l23, k1024;
            }""",
            constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        return nibble_to(packed >> 4, tl.float16, BIT_DEQUANT), nibble_to(packed & 0xF, tl.float16, BIT_DEQUANT)


# The batch-1 and few-rows kernels' forms of the trick (triton_gemv.py, triton_rows.py): a word of
# packed columns at a time, widened to fp32 (their products are fp32).

@triton.jit
def int8_quad(words):
    """int32 words of 4 int8 (columns 4w..4w+3, byte i = column 4w + i) -> 4 fp32 of 1152 + b.

    b ^ 0x80 = b + 128 as an unsigned byte; prmt puts it under 0x64 to make the fp16 1024 + b + 128
    (two columns per prmt, the trick FasterTransformer uses), widened to fp32 exactly."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, p0, p1;
            .reg .b16 h0, h1, h2, h3;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 p0, t, 0x64646464, 0x4140;
            prmt.b32 p1, t, 0x64646464, 0x4342;
            mov.b32 {h0, h1}, p0;
            mov.b32 {h2, h3}, p1;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        return (((words << 24) >> 24).to(tl.float32) + 1152.0, ((words << 16) >> 24).to(tl.float32) + 1152.0,
                ((words << 8) >> 24).to(tl.float32) + 1152.0, (words >> 24).to(tl.float32) + 1152.0)


@triton.jit
def nibble_pair(words, SHIFT: tl.constexpr):
    """int32 words -> (1024 + bits [SHIFT, SHIFT + 4), 1024 + bits [16 + SHIFT, 20 + SHIFT)) as fp32."""
    if PTX:
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            .reg .b16 lo, hi;
            shr.u32 t, $2, {SHIFT};
            lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA;
            mov.b32 {{lo, hi}}, t;
            cvt.f32.f16 $0, lo;
            cvt.f32.f16 $1, hi;
            }}""",
            constraints="=r,=r,r", args=[words], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = ((words >> SHIFT) & 0xF).to(tl.float32) + 1024.0
        hi = ((words >> (16 + SHIFT)) & 0xF).to(tl.float32) + 1024.0
        return lo, hi


# The batch-1 kernels' weight words, each K step's loaded one step ahead or in its step
# (AHEAD: triton_gemv.LOAD_AHEAD).  `w_ptrs` point at the words of the step at k = 0, `columns` of
# K a word; a loop carries `ahead` (0 without AHEAD):
#     ahead = first_words(w_ptrs, k0, columns, AHEAD)
#     for k in ...: words, ahead = step_words(w_ptrs, k, end, ahead, BLOCK_K, columns, AHEAD)

@triton.jit
def first_words(w_ptrs, k0, columns: tl.constexpr, AHEAD: tl.constexpr):
    if AHEAD:
        return tl.load(w_ptrs + k0 // columns, eviction_policy="evict_first")
    else:
        return 0


@triton.jit
def step_words(w_ptrs, k, end, ahead, BLOCK_K: tl.constexpr, columns: tl.constexpr, AHEAD: tl.constexpr):
    """(this step's words, what the loop carries): with AHEAD the words loaded a step ago, and the
    next step's loaded now (none past `end`); otherwise this step's, loaded now."""
    if AHEAD:
        live = tl.full((1,), k + BLOCK_K, tl.int32) < end  # a tensor: the interpreter takes no bare bool mask
        return ahead, tl.load(w_ptrs + (k + BLOCK_K) // columns, mask=live, other=0, eviction_policy="evict_first")
    else:
        return tl.load(w_ptrs + k // columns, eviction_policy="evict_first"), ahead


# Dequantize-then-cuBLAS for prompts: one pass that reads the packed weights and writes the fp16
# copy once (2-2.5 bytes written and 0.5-1 read per weight), where torch ops took a pass per
# step (convert, scale, add: ~7 bytes moved per weight).  On a T4, whose Triton `tl.dot` has no
# tensor cores, this is the prompt path that uses them; elsewhere the launcher times it against
# the fused tiles.

@triton.jit
def _int8_dense_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], (w.to(tl.float32) * s[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _int4_dense_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    # One quantization group of BLOCK_N rows per program: one scale and one offset per row.
    # packed uint8 [N, K/2]: column 2j in the high nibble of byte j, 2j + 1 in the low one.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    rj = g * (GROUP // 2) + tl.arange(0, GROUP // 2)
    rows = rn[:, None] < N
    packed = tl.load(w_ptr + rn[:, None] * (K // 2) + rj[None, :], mask=rows, other=0)
    q = tl.interleave(packed >> 4, packed & 0xF).to(tl.float32)  # [BN, GROUP]: columns 2j, 2j + 1
    s = tl.load(s_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0).to(tl.float32)
    rk = g * GROUP + tl.arange(0, GROUP)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], (q * s[:, None] + z[:, None]).to(out_ptr.dtype.element_ty),
             mask=rows)


_DENSE_BLOCK = (32, 256)  # 8 KB of int8 or 4 KB of packed int4 per program


def dequantize_int8(weight, scales, dtype):
    """int8 [N, K] and per-row scales [N] -> `dtype` [N, K]."""
    import torch

    N, K = weight.shape
    out = torch.empty((N, K), device=weight.device, dtype=dtype)
    bn, bk = _DENSE_BLOCK
    _int8_dense_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](weight, scales, out, N, K, BLOCK_N=bn, BLOCK_K=bk)
    return out


def dequantize_int4(packed, scales, mins, group: int, dtype):
    """packed uint8 [N, K/2], per-group scales / mins [N, K/group] -> `dtype` [N, K] (q * s + m)."""
    import torch

    N, K = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((N, K), device=packed.device, dtype=dtype)
    bn = _DENSE_BLOCK[0] * _DENSE_BLOCK[1] // group  # as many weights a program as int8's
    _int4_dense_kernel[(triton.cdiv(N, bn), K // group)](packed, scales, mins, out, N, K, GROUP=group, BLOCK_N=bn)
    return out
