"""Weight-only int8 / int4 matrix-vector kernels for batch-1 decode: y[1, N] = x[1, K] @ dequant(W).T

At batch 1 the tiled kernels in `triton_mm.py` spend a 16-row `tl.dot` tile on one row of
activations, and on a fast GPU they were measured bound by that work rather than by memory
(bench/RESULTS.md: 8B int8 0.99x fp16).  These kernels do no tensor-core work: each program
multiplies a [BLOCK_N, BLOCK_K] weight tile, converted in registers, by the matching slice of x
and reduces along K, and many programs per layer (K split SPLIT_K ways, results added atomically)
keep enough loads in flight to stream the weights.  `triton_mm._launch` times both kinds per
layer shape at start-up and keeps the faster, so these are used only where they win.

The signatures match the tiled kernels' (BLOCK_M is accepted and ignored), so one launcher serves
both.  Import only where Triton and a CUDA GPU exist.
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import AUTOTUNE_ON_DISK, int8_to, nibble_to


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=3)
            for bn, bk, split, warps in ((64, 128, 1, 4), (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 2, 4),
                                         (128, 64, 8, 4), (64, 64, 16, 4), (32, 256, 8, 4), (16, 256, 1, 4),
                                         (128, 128, 1, 8), (64, 256, 1, 8), (128, 128, 4, 8))]


def _prune(configs, named_args, **kwargs):
    K = named_args["K"]
    group = named_args.get("GROUP") or kwargs.get("GROUP") or 1 << 30
    return [c for c in configs
            if K % (c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"]) == 0 and c.kwargs["BLOCK_K"] <= group]


@triton.jit
def _store_row(out_ptr, acc, rn, N, SPLIT_K: tl.constexpr):
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        tl.atomic_add(out_ptr + rn, acc, mask=rn < N, sem="relaxed")


@triton.jit
def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      BIT_DEQUANT: tl.constexpr = True):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = K // SPLIT_K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < N, other=0)  # [BN, BK]
        acc += tl.sum(int8_to(w, tl.float32, BIT_DEQUANT) * x[None, :], axis=1)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    _store_row(out_ptr, acc * scale, rn, N, SPLIT_K)


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, BIT_DEQUANT: tl.constexpr = False):
    # BIT_DEQUANT off: for nibbles into fp32 Triton's own conversion was the faster one in every
    # layer measured (bench/RESULTS.md: lm_head 204 vs 231 us on an H200).
    # Packing as in triton_mm: column 2j in the high nibble of byte j, 2j+1 in the low one; a K
    # tile lies inside one group, so x . (q * s + z) = s * (x . q) + z * sum(x).
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = BLOCK_K // 2
    k_len = K // SPLIT_K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        rj = k // 2 + tl.arange(0, HALF)
        x_hi = tl.load(x_ptr + 2 * rj).to(tl.float32)
        x_lo = tl.load(x_ptr + 2 * rj + 1).to(tl.float32)
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + rj[None, :], mask=rn[:, None] < N, other=0)
        q_hi = nibble_to(packed >> 4, tl.float32, BIT_DEQUANT)
        q_lo = nibble_to(packed & 0xF, tl.float32, BIT_DEQUANT)
        part = tl.sum(q_hi * x_hi[None, :] + q_lo * x_lo[None, :], axis=1)
        xsum = tl.sum(x_hi, axis=0) + tl.sum(x_lo, axis=0)
        g = k // GROUP
        s = tl.load(s_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0).to(tl.float32)
        acc += part * s + xsum * z
    _store_row(out_ptr, acc, rn, N, SPLIT_K)


def _tuned(kernel):
    return triton.autotune(configs=_configs(), key=["N", "K"], prune_configs_by={"early_config_prune": _prune},
                           reset_to_zero=["out_ptr"], **AUTOTUNE_ON_DISK)(kernel)


int8_gemv_kernel, int4_gemv_kernel = _tuned(_int8_gemv_kernel), _tuned(_int4_gemv_kernel)
