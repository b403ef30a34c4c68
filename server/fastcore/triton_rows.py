"""int4 weights times a few rows of activations (decode batches of 2-16), without tensor cores:
y[M, N] = x[M, K] @ dequant(W).T with each weight converted once for all M rows.

At batch 8 the tiled int4 kernel (triton_mm.py: `tl.dot` on 16-row tiles) streamed its weights at
~25 % of copy bandwidth on an H100 and took 1.02x fp16's time per decode step (bench/RESULTS.md,
2026-12-04 night): its grids are small and each K step converts a tile into the MMA's operand
layout.  The matrix-vector kernel (triton_gemv.py) streams int4 at 55-63 % on the large layers
with plain FMAs; its cost is instructions, ~16 to turn a word of 8 nibbles into fp32 and 8
multiply-adds.  Here the same loop serves BLOCK_M rows: the conversion is paid once per weight,
the multiply-adds once per weight and row: each weight becomes fp32 (one lop3 per two, one
conversion, one fused multiply-add with its scale and offset) once, then costs one FMA per row,
~2.5 + M instructions a weight where M matrix-vector calls cost ~3.3 M.  Past M ~ 8 that outgrows
an H100's bandwidth budget and the tiled kernel wins; the launcher (triton_mm._launch) times both
per shape and batch size and keeps the faster.

Layout as triton_gemv's int4 kernel: int32 words of 8 columns read one per thread and row, the
warps side by side along K; column 2i in the high nibble of byte i.  A word's 8 columns lie
inside one group (one scale and offset per word and row); the nibbles become 1024 + q by
Marlin's lop3 trick (`nibble_pair`), and the 1024 comes off with the offset.
Rows past M read row M - 1 and are not stored; rows past N likewise.

Import only where Triton and a CUDA GPU exist (TRITON_INTERPRET=1 on a CPU runs the arithmetic).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import AUTOTUNE_OPTIONS, nibble_pair

# (BLOCK_N, BLOCK_K, warps): one word per thread and row, BLOCK_K = 256 * warps; the accumulators
# are BLOCK_M x BLOCK_N fp32 a thread, so wide row blocks pair with few weight rows (_prune)
_SHAPES = ((4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (8, 512, 2), (16, 512, 2), (8, 256, 1))


MAX_ACC = 128  # accumulators a thread (BLOCK_M x BLOCK_N), under the 255 registers with the rest


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "K_FIRST": first}, num_warps=w, num_stages=1)
            for bn, bk, w in _SHAPES for first in (True, False)]


def _prune(configs, named_args, **kwargs):
    K = named_args["K"]
    block_m = kwargs.get("BLOCK_M") or named_args.get("BLOCK_M") or 1
    return [c for c in configs if K % c.kwargs["BLOCK_K"] == 0 and block_m * c.kwargs["BLOCK_N"] <= MAX_ACC]


def fits(K: int) -> bool:
    """Whether a config covers K in whole blocks (K a multiple of 256)."""
    return any(K % bk == 0 for _, bk, _ in _SHAPES)


def block_m(M: int) -> int:
    """Rows a program takes: M rounded up to a power of two, at most 8 (more programs past that)."""
    return min(8, 1 << (M - 1).bit_length())


@triton.jit(do_not_specialize=["M", "M_BUCKET"], do_not_specialize_on_alignment=["K"])
def _int4_rows_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, K_FIRST: tl.constexpr = True):
    # Every tensor is 3-D, with size-1 axes where it does not vary, so that the loads, the weights'
    # conversion and the products can share one layout with the threads along K.  Which order of
    # the axes gets it is up to Triton's choice of layout for loads whose addresses are no more
    # contiguous along one axis than another (x's, the scales'): Triton 3.6 puts the threads along
    # the first axis, 3.9 along the last.  In the other order it moved x or the weights through
    # shared memory on every K step (24-52 barriers a step in the sm_90 SASS, `bench sass --loop`;
    # none in the right one), so both orders are configs and the autotuner keeps the faster.
    W: tl.constexpr = BLOCK_K // 8
    pid_n, pid_m = tl.program_id(0), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # 3-D index tensors, weight rows and rows of x clamped (read, never stored): [words, weight
    # rows, rows of x] with K_FIRST, else [rows of x, weight rows, words]
    rows = tl.minimum(rn, N - 1)[None, :, None]
    if K_FIRST:
        xm, rw = tl.minimum(rm, M - 1)[None, None, :], tl.arange(0, W)[:, None, None]
    else:
        xm, rw = tl.minimum(rm, M - 1)[:, None, None], tl.arange(0, W)[None, None, :]
    x_rows = x_ptr + xm * stride_xm
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + rw + rows * (K // 8)
    sz_off = (8 * rw) // GROUP + rows * (K // GROUP)
    if K_FIRST:
        acc = tl.zeros((W, BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, W), dtype=tl.float32)
    # no loads a step ahead here (triton_gemv's LOAD_AHEAD): on an H100 they made this kernel 4-25 %
    # slower at 4-16 rows on every 8B layer (bench/RESULTS.md, 2026-12-06 second lease)
    for k in range(0, K, BLOCK_K):
        k = tl.multiple_of(k, BLOCK_K)
        words = tl.load(w_ptrs + k // 8, eviction_policy="evict_first")  # int32: along words and weight rows
        s = tl.load(s_ptr + sz_off + k // GROUP).to(tl.float32)
        m = tl.load(z_ptr + sz_off + k // GROUP).to(tl.float32) - 1024.0 * s  # the 1024 of 1024 + q
        for p in tl.static_range(4):
            # the columns of bits 4p and 16 + 4p: 2 (p // 2) + 1 - p % 2 and 4 more
            c = 2 * (p // 2) + 1 - p % 2
            x_lo = tl.load(x_rows + (k + 8 * rw + c)).to(tl.float32)  # varying along words and rows of x
            x_hi = tl.load(x_rows + (k + 8 * rw + c + 4)).to(tl.float32)
            q_lo, q_hi = nibble_pair(words, 4 * p)  # 1024 + q
            # the weight itself, once for all rows: (1024 + q) s + (m - 1024 s) in one fused
            # multiply-add, rounded once (= q s + m to fp32's precision); then one FMA a row
            acc += (q_lo * s + m) * x_lo
            acc += (q_hi * s + m) * x_hi
    if K_FIRST:
        y = tl.trans(tl.sum(acc, axis=0))  # [BM, BN]
    else:
        y = tl.sum(acc, axis=2)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


int4_rows_kernel = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"],
                                   prune_configs_by={"early_config_prune": _prune}, **AUTOTUNE_OPTIONS)(
    _int4_rows_kernel)
