"""Exact int8 / int4 -> float in registers with integer ops, for the weight-only kernels.

A decode kernel converts every weight it streams, and a GPU's int -> float conversion runs at a
fraction of its arithmetic rate (16 results per clock per multiprocessor on sm_80/sm_90, against
128 fp32 FMAs).  A float whose exponent makes the mantissa's last bit worth 1 (fp16: 1024.0,
bits 0x6400; fp32: 2**23, bits 0x4B000000) turns an integer added into its bits into that float
plus the integer, so an integer add and one float subtraction give the exact value (the trick
FasterTransformer and Marlin use).

The tiled kernels (triton_mm.py) use these; BIT_DEQUANT=False keeps Triton's plain `.to()`
conversion, and the launcher times both.  The batch-1 matrix-vector kernels (triton_gemv.py) do the
same trick two columns at a time in inline PTX, of their own.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl


def quick_bench(kernel_call, quantiles=None):
    """The weight kernels' timer at start-up.  Triton's default runs every candidate for 25 ms of
    warm-up and 100 ms of timing; over the ~50 (layer shape, forward size) pairs a model tunes,
    with 3-7 candidates each, that was most of a cold start's ~30 s of tuning.  A weight kernel
    runs for 5-600 µs, so 20 ms still averages 30 or more calls (the L2 cache flushed between
    them, as do_bench does)."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# The autotuners' options, where this Triton has them: the quick timer, and the choices kept on
# disk with the compiled kernels (compile_cache.py), so that a warm start times no configs at all.
_AUTOTUNE_PARAMETERS = inspect.signature(triton.autotune).parameters
AUTOTUNE_OPTIONS = ({"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMETERS else {}) | (
    {"do_bench": quick_bench} if "do_bench" in _AUTOTUNE_PARAMETERS else {})


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
