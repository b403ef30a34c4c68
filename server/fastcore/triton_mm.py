"""Weight-only int8 / int4 matmuls for decode, as Triton kernels: y[M, N] = x[M, K] @ dequant(W)[N, K].T

Decode reads every weight once per step, so a weight-only kernel is fast exactly when it streams
the packed weights at memory bandwidth and never writes a dequantized copy.  These kernels load
an int8 (or packed int4) tile, convert it in registers and feed `tl.dot` (fp32 accumulation; on
tensor cores from sm_80 on, FMAs below: a T4); the per-channel (int8) or per-group (int4) scales
are applied to the tile's partial sums.  One kernel serves every decode batch (M = 1..64): rows
past M are masked.  Each kernel computes either x @ W.T or W @ x.T (SWAP), whichever its timings
pick per shape.  Batch 1 has kernels of its own (triton_gemv.py); prompts (M > 64) take 128-row
tiles, dequantize-then-cuBLAS (triton_dequant.py) or, on sm_90, TMA-fed wgmma tiles
(triton_wgmma.py), whichever is fastest for the shape.

Skinny layers (the 8B model's down projection: N = 4096 outputs, K = 14336) give too few output
tiles to keep every multiprocessor busy, so K may be split over SPLIT_K programs, whose partial
sums are added in a fixed order afterwards (triton_splits.py).

Import this module only where Triton and a CUDA GPU exist (quant.py checks first).
Each op is a `torch.library.custom_op`: torch.compile treats it as one opaque call, and the CUDA
graph around the decode step captures its launch.  Block sizes come from `triton.autotune`, keyed
on the shape, so the first call for each (M bucket, N, K) tunes once; `FastCore.warm_up` makes
those first calls before any request arrives.
"""

from __future__ import annotations

import sys

import torch


import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import (AUTOTUNE_OPTIONS, TENSOR_CORE_DOT, compiling_ahead,
                                                       dequantize_int4, dequantize_int8, int8_to, nibbles_to_fp16)
from quantserve.server.fastcore.kernel_timing import graph_times, quick_bench
from quantserve.server.fastcore import dependent_launch, triton_dp4a as dp4a, triton_splits as splits
from quantserve.server.fastcore import triton_wgmma as wgmma
from quantserve.server.fastcore.triton_gemv import fits as gemv_fits, int4_gemv_kernel, int8_gemv_kernel
from quantserve.server.fastcore.triton_rows import block_m as rows_block_m, fits as rows_fit, int4_rows_kernel
from quantserve.server.fastcore.triton_splits import store_tile


# M (the rows: a decode batch, a forward's tokens) is not specialized on: Triton compiles a kernel
# per divisibility class of its integer arguments, and a prompt of 716 tokens after warm-up's
# 512 and 1024 compiled new kernels while requests waited (a quarter of a server's time, py-spy).
# Nor is M_BUCKET, the autotuners' key alone (unused in the kernels): tuning passes the choice's
# bucket (int4's 2, 4, 8), a launch the tile height (16), and each would be a compile of its own.


def _configs(mma: bool | None = None):
    # Few configs on purpose: each one is a Triton compile (~1 s) per shape at start-up.  mma: for a
    # GPU whose tl.dot is tensor-core MMA (default: this one's, TENSOR_CORE_DOT).  Where it is FMAs
    # (a T4) every one of these spilled 1.7-2.6 KB a thread (sm_75, Triton 3.6, 16 rows); the
    # FMA list's configs spill nothing there (`python -m quantserve.bench.sass --t4-tiles`).
    if not (TENSOR_CORE_DOT if mma is None else mma):
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": split, "SWAP": swap}, num_warps=8,
                              num_stages=1) for swap in (False, True) for bn in (32, 64) for split in (1, 4)]
    out = [triton.Config({"BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": split, "SWAP": swap}, num_warps=4, num_stages=4)
           for swap in (False, True) for bn in (64, 128) for split in (1, 4)]
    out.append(triton.Config({"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8}, num_warps=4, num_stages=4))
    out.append(triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1}, num_warps=4, num_stages=4))  # any K % 64
    return out


def _prune(configs, named_args, **kwargs):
    """Keep configs whose K split is whole blocks (and inside one int4 group), and split K only
    when the output tiles are too few to fill the GPU."""
    N, K = named_args["N"], named_args["K"]
    group = named_args.get("GROUP") or kwargs.get("GROUP") or 1 << 30
    keep = []
    for c in configs:
        bn, bk, split = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]
        if K % (bk * split) or bk > group:
            continue
        if split > 1 and N // bn >= 264:  # already 2 tiles per multiprocessor on a 132-SM GPU
            continue
        keep.append(c)
    return keep


# ROWS_FIRST (a prompt's several row tiles): the grid's first axis walks the row tiles, so the
# programs that share a weight tile run side by side and read it from HBM once (from L2 after the
# first).  With the output tiles first, a weight tile's row tiles lie N / BLOCK_N programs apart:
# where that is more than the GPU runs at once (the 8B's gate_up, 224 tiles of 128 outputs; any
# layer of lm_head's width), each row tile streamed the whole weight again, as did every long
# prompt's 16 or more row tiles once the weight outgrew L2.

@triton.jit
def tile_ids(ROWS_FIRST: tl.constexpr):
    """(output tile, K split, row tile) of this program; `tiled_grid` orders the grid to match."""
    if ROWS_FIRST:
        return tl.program_id(2), tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2)


def _rows_first(fn, M: int, block_m: int, extra: dict) -> bool:
    """Whether `fn` over M rows walks its row tiles first: the tiled kernels with more than one row
    tile do, unless `extra` sets ROWS_FIRST itself (the kernel race's baseline)."""
    return _kernel_name(fn) in _TILED and bool(extra.get("ROWS_FIRST", M > block_m))


def tiled_grid(fn, M: int, N: int, block_m: int, block_n: int, split: int, extra: dict) -> tuple[tuple, dict]:
    """(launch grid, ROWS_FIRST flag to pass) for `fn` over M rows (_rows_first; every other kernel,
    and one row tile, keep output tiles first)."""
    m_tiles, n_tiles = -(-M // block_m), -(-N // block_n)
    if _rows_first(fn, M, block_m, extra):
        return (m_tiles, split, n_tiles), {"ROWS_FIRST": True}
    return (n_tiles, split, m_tiles), {}


# SWAP: compute y.T = W @ x.T, the converted weight tile as `tl.dot`'s first operand.  On sm_90
# Triton then feeds the tile to wgmma from registers and keeps several wgmmas in flight; as the
# second operand it is written back to shared memory each K step and every wgmma is waited for.
# On a GPU without wgmma the launcher times both orientations.

@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _int8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 BIT_DEQUANT: tl.constexpr = True, SWAP: tl.constexpr = False, ROWS_FIRST: tl.constexpr = False):
    pid_n, pid_k, pid_m = tile_ids(ROWS_FIRST)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = K // SPLIT_K
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        if SWAP:
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=rm[None, :] < M, other=0.0)  # [BK, BM]
            w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < N, other=0)  # [BN, BK]
            acc += tl.dot(int8_to(w, xt.dtype, BIT_DEQUANT), xt)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M, other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=rn[None, :] < N, other=0)  # [BK, BN]
            acc += tl.dot(x, int8_to(w, x.dtype, BIT_DEQUANT))
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if SWAP:
        acc = acc * scale[:, None]
    else:
        acc = acc * scale[None, :]
    store_tile(out_ptr, acc, rm, rn, M, N, stride_om, SPLIT_K, SWAP)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, M_BUCKET, stride_xm, stride_om,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, BIT_DEQUANT: tl.constexpr = True, SWAP: tl.constexpr = False,
                 Z_DOT: tl.constexpr = TENSOR_CORE_DOT, ROWS_FIRST: tl.constexpr = False):
    # w_ptr: uint8 [N, K/2], column 2j in the high nibble, 2j+1 in the low one.  Each packed tile
    # [BN, BK/2] becomes its high and low nibbles as fp16 in one PTX block per four bytes
    # (nibbles_to_fp16), interleaved back into column order [BN, BK] in registers, and meets x's
    # contiguous tile in one `tl.dot` of full depth (as the first operand with SWAP: W @ x.T).
    # A K tile lies inside one quantization group (BLOCK_K <= GROUP, both powers of two), so
    # x . (q * s + z) = s * (x . q) + z * sum(x), with one scale and one offset per output: the
    # integers go to `tl.dot` exactly (dequantizing the tile to q * s + z in registers first
    # measured 1.1-1.2x slower at batch 8 and 32).  With Z_DOT, z * sum(x) is a second `tl.dot`
    # against the offsets broadcast along K: tensor-core work, idle at these sizes, where a sum of x
    # across threads at every K step was a third of the loop's instructions (sm_90 SASS).  Where
    # Triton's `tl.dot` is FMAs (below sm_80: a T4) that would double the multiply-adds: off there.
    pid_n, pid_k, pid_m = tile_ids(ROWS_FIRST)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    HALF: tl.constexpr = BLOCK_K // 2
    k_len = K // SPLIT_K
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        rj = k // 2 + tl.arange(0, HALF)  # packed byte index
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + rj[None, :], mask=rn[:, None] < N, other=0)  # [BN, BK/2]
        g = k // GROUP
        s = tl.load(s_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rn * (K // GROUP) + g, mask=rn < N, other=0.0)
        hi, lo = nibbles_to_fp16(packed, BIT_DEQUANT)
        if SWAP:
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=rm[None, :] < M, other=0.0)  # [BK, BM]
            acc += tl.dot(tl.interleave(hi, lo).to(xt.dtype), xt) * s[:, None]  # [BN, BM]
            if Z_DOT:
                acc += tl.dot(tl.broadcast_to(z.to(xt.dtype)[:, None], (BLOCK_N, BLOCK_K)), xt)
            else:
                acc += z.to(tl.float32)[:, None] * tl.sum(xt.to(tl.float32), axis=0)[None, :]
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=rm[:, None] < M, other=0.0)  # [BM, BK]
            acc += tl.dot(x, tl.trans(tl.interleave(hi, lo).to(x.dtype))) * s[None, :]  # [BM, BN]
            if Z_DOT:
                acc += tl.dot(x, tl.broadcast_to(z.to(x.dtype)[None, :], (BLOCK_K, BLOCK_N)))
            else:
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * z.to(tl.float32)[None, :]
    store_tile(out_ptr, acc, rm, rn, M, N, stride_om, SPLIT_K, SWAP)


def _prompt_configs(wide: bool = False):
    # prompt-sized M (> 64 rows): 128-row tiles, so each weight tile is converted once per 128 rows.
    # Timed against dequantize-then-cuBLAS per shape: on an H200 at M = 512 (with output tiles first
    # in the grid) the dense path beat all of these on 3 of the 8B's 4 layers (bench/RESULTS.md).
    # wide (int8): also 256 weight rows a tile, W @ x.T, which halves x's loads per weight; int4's
    # unpacking spills registers at that width (sm_90 SASS: 212 STL), so int4 stays at 128.
    shapes = [(False, 128, 8, 3), (False, 128, 4, 4), (True, 128, 8, 3), (True, 64, 4, 4)] + ([(True, 256, 8, 3)] if wide else [])
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": 1, "SWAP": swap}, num_warps=warps,
                          num_stages=stages) for swap, bn, warps, stages in shapes]


PROMPT_BLOCK_M = 128


def _adding_timed_too(nargs: dict, exception=None) -> None:
    """The autotuners' post-hook, inside each timed call: a split-K config is timed with the adding
    of its splits (into a scratch output), as it runs, so that its extra traffic counts."""
    if nargs["SPLIT_K"] > 1 and exception is None:
        part, M, N = nargs["out_ptr"], nargs["M"], nargs["N"]
        splits.add_splits(part, torch.empty((M, N), device=part.device, dtype=nargs["x_ptr"].dtype), nargs["SPLIT_K"])


def _tuned(kernel, configs=_configs):
    return triton.autotune(configs=configs(), key=["M_BUCKET", "N", "K"],
                           prune_configs_by={"early_config_prune": _prune}, post_hook=_adding_timed_too,
                           **AUTOTUNE_OPTIONS)(kernel)


_TILED = ("_int8_kernel", "_int4_kernel")  # the kernels that take ROWS_FIRST
int8_kernel, int4_kernel = _tuned(_int8_kernel), _tuned(_int4_kernel)
int8_prompt_kernel = _tuned(_int8_kernel, lambda: _prompt_configs(wide=True))
int4_prompt_kernel = _tuned(_int4_kernel, _prompt_configs)


def _block_m(M: int) -> int:
    return 16 if M <= 16 else (32 if M <= 32 else 64)


def _m_bucket(M: int, fine: bool = False) -> int:
    """Shapes sharing one choice: decode batches by tile height; prompts (M > 64) by the next power
    of two, since the dense path's fixed cost (a dequantized weight copy) pays off only on long ones.
    fine (int4, whose few-rows kernel's cost grows with the rows): batches up to 16 by the next
    power of two, each its own choice."""
    if fine and M <= 16:
        return 1 << (M - 1).bit_length()
    return _block_m(M) if M <= 64 else 1 << (M - 1).bit_length()


def _int8_dense(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Prefill-sized M: the whole weight dequantized to x's dtype in one pass, then one cuBLAS
    matmul.  Writes and reads a dense copy, which long prompts amortise over many rows."""
    return torch.mm(x, dequantize_int8(weight, scales, x.dtype).t())


def _int4_dense(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group: int) -> torch.Tensor:
    return torch.mm(x, dequantize_int4(packed, scales, mins, group, x.dtype).t())


# (kernel name, M bucket, batch 1?, N, K, dtype, group) -> (kernel, config, BLOCK_M, flags) chosen for
# it; flags: keyword arguments of the kernel the choice fixed (the dequantization trick or not)
_chosen: dict[tuple, tuple] = {}
# the prompt keys of _chosen whose choice was made with the sm_90 wgmma kernels among the candidates
# (kernel_choices.py tunes a kept prompt choice again on an sm_90 GPU where they were not)
_with_wgmma: set[tuple] = set()


def _tune(tuned, block_m: int, M: int, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict,
          bucket: int | None = None) -> tuple:
    """Run `tuned`'s autotuner for this shape (it times its configs into an fp32 buffer with room
    for the most splits of K any of them takes; `bucket`: its key's M, _m_bucket(M) unless given)
    -> (kernel, best config, BLOCK_M, {})."""
    most = max([c.kwargs["SPLIT_K"] for c in _prune(tuned.configs, {"N": N, "K": K, **extra})] or [1]) \
        if tuned in (int8_kernel, int4_kernel) else 1  # the others' configs never split K
    out = torch.empty((most * M, N), device=x.device, dtype=torch.float32)

    if _rows_first(tuned.fn, M, block_m, extra):  # the same for every config of `tuned`
        extra = {**extra, "ROWS_FIRST": True}

    def grid(meta):
        return tiled_grid(tuned.fn, M, N, block_m, meta["BLOCK_N"], meta["SPLIT_K"], extra)[0]
    # M_BUCKET is the autotuners' key: a prompt bucket (a power of two past 64) tunes its own tiles
    call = (*args, out, M, N, K, bucket or _m_bucket(M), x.stride(0), out.stride(0))
    with compiling_ahead():  # every config the autotuner is about to time, before it times them one by one
        tuned.warmup(*call, grid=(1,), BLOCK_M=block_m, **extra)
    tuned[grid](*call, BLOCK_M=block_m, **extra)
    return (tuned.fn, tuned.best_config, block_m, {})


def _optional(tune) -> list[tuple]:
    """[the candidate `tune` returns], or [] with a warning on stderr where it fails to build or run
    on this GPU and Triton: a newer kernel (triton_rows.py) is a candidate beside the tiled one,
    never a new way for a layer to fail."""
    try:
        return [tune()]
    except Exception as e:  # noqa: BLE001  (Triton's compile and launch errors have no common base)
        print(f"warning: a weight-kernel candidate failed ({type(e).__name__}: {str(e)[:200]}); "
              "the tiled kernel serves that shape", file=sys.stderr)
        return []


def _fastest(choices: list[tuple], M: int, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict) -> tuple:
    """The choice whose whole call (output allocation, and the adding of the splits where it splits
    K) takes least GPU time, timed with the L2 cache flushed between calls as a decode step sees it,
    among those whose result agrees with the first choice's (_agreeing).  Calls are timed inside a
    CUDA graph, as the decode and prompt steps replay them.  One call at a time, the host's work
    that outlasts the flush is counted as GPU time: a split-K call of several launches lost to a
    one-launch kernel 1.7x slower on the GPU (kernel_timing.py), and at 512 rows the wgmma kernels,
    which build their TMA descriptors on the host, lost int4's o layer to dequantize-then-cuBLAS,
    1.27x their time in the race (bench/RESULTS.md, 2026-12-07)."""
    if len(choices) == 1:
        return choices[0]
    with compiling_ahead():  # the batch-1 kernels' variants (BIT_DEQUANT, HALF_DOT) are new compiles
        for c in choices:
            try:
                run_choice(*c[:3], M, N, K, x, args, {**extra, **c[3]}, warmup=True)
            except Exception:  # noqa: BLE001  (left to its first real call, in _agreeing, which reports it)
                pass
    choices = _agreeing(choices, M, N, K, x, args, extra)  # runs each once: loaded before any capture
    calls = [lambda c=c: run_choice(*c[:3], M, N, K, x, args, {**extra, **c[3]}) for c in choices]
    times = graph_times(calls) if x.is_cuda else [quick_bench(call) for call in calls]
    return choices[times.index(min(times))]


def _agreeing(choices: list[tuple], M: int, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict) -> list[tuple]:
    """The choices whose output on this call's input agrees with the first's (the tiled kernel,
    plain `tl.dot`) to 1 % of its largest value: the bit tricks in inline PTX are only tested on the
    GPUs they ran on, and a variant that computes something else on another GPU must not win on
    speed.  One that disagrees, or fails to compile or run here, is left out, and said so on
    stderr.  Only the first 64 rows are compared: enough to catch a wrong kernel, and a prompt's
    outputs are hundreds of MB each (at warm-up, under a 15 GiB cap)."""
    def rows(c):
        return run_choice(*c[:3], M, N, K, x, args, {**extra, **c[3]})[:64].float()

    ref = rows(choices[0])
    if not torch.isfinite(ref).all():  # nothing to judge by (the reference itself is kept either way)
        return choices
    bound = 1e-2 * ref.abs().max().item() + 1e-3
    keep = choices[:1]
    for c in choices[1:]:
        try:
            err = (rows(c) - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001  (Triton's compile and launch errors have no common base)
            print(f"warning: weight kernel {_kernel_name(c[0])} {_config_text(c)} for {M}x{N}x{K} failed "
                  f"({type(e).__name__}: {str(e)[:200]}); not used", file=sys.stderr)
            continue
        if err <= bound:  # NaN compares False: left out too
            keep.append(c)
        else:
            print(f"warning: weight kernel {_kernel_name(c[0])} {_config_text(c)} for {M}x{N}x{K} differs from "
                  f"the tiled kernel by {err:.3g} (bound {bound:.3g}); not used", file=sys.stderr)
    return keep


def _config_text(choice: tuple) -> str:
    config = choice[1]
    return f"{config.kwargs if config is not None else 'dense'} {choice[3]}"


def _launch(kernel, M: int, N: int, x: torch.Tensor, args: tuple, gemv=None, dense=None, prompt=None,
            rows=None, **extra) -> torch.Tensor:
    """Run `kernel` (or, at batch 1, `gemv`; at 2-16 rows, `rows`; for a prompt, `prompt`'s 128-row
    tiles, `dense` or on sm_90 triton_wgmma's kernels, where faster) for this shape's chosen config.

    The first call for a shape tunes: each autotuner picks its best config, then the kinds'
    winners are timed against each other (at batch 1: tiled, matrix-vector with and without the
    bit-pattern dequantization, int4's packed fp16 products, x rounded to int8 for dp4a; at 2-16
    rows: tiled and the few-rows kernel; for M > 64: tiled on 64 rows, 128-row tiles,
    dequantize-then-cuBLAS, the wgmma kernels' configs) and the fastest is kept.  Later calls
    launch the choice directly."""
    K = x.shape[1]
    bucket = _m_bucket(M, fine=rows is not None)
    key = (kernel.fn.__name__, bucket, M == 1, N, K, x.dtype, extra.get("GROUP"))  # batch 1 has its own choice
    if key not in _chosen:
        if M > 64 and dense is not None:
            _launch(kernel, 64, N, x[:64], (x[:64],) + args[1:], **extra)  # tunes the tiles on 64 rows
            choices = [_chosen[(kernel.fn.__name__, 64, False, N, K, x.dtype, extra.get("GROUP"))], (dense, None, 0, {})]
            if prompt is not None and TENSOR_CORE_DOT:  # on FMAs (a T4) 128-row tiles lose to cuBLAS, and spill
                choices.append(_tune(prompt, PROMPT_BLOCK_M, M, N, K, x, args, extra))
            if wgmma.usable(x):  # sm_90: TMA-fed tiles, the weight dequantized as wgmma's first operand
                fn = wgmma.int4_wgmma_mm if "GROUP" in extra else wgmma.int8_wgmma_mm
                choices += [(fn, c, c.kwargs["BLOCK_M"], {}) for c in wgmma.configs_for(K, extra.get("GROUP"))]
                _with_wgmma.add(key)
        else:
            choices = [_tune(kernel, _block_m(M), M, N, K, x, args, extra, bucket)]
            if rows is not None and 1 < M <= 16 and rows_fit(K):
                choices += _optional(lambda: _tune(rows, rows_block_m(M), M, N, K, x, args, extra, bucket))
            if gemv is not None and M == 1 and gemv_fits(gemv, K):
                fn, config, block_m, _ = _tune(gemv, 1, M, N, K, x, args, extra)
                choices += [(fn, config, 1, {"BIT_DEQUANT": bits}) for bits in (True, False)]
                if gemv is int4_gemv_kernel:  # products in packed fp16 (triton_gemv._nibble_dot)
                    choices.append((fn, config, 1, {"BIT_DEQUANT": True, "HALF_DOT": True}))
                if dp4a.enabled():  # x rounded to int8, integer products (triton_dp4a.py)
                    choices += [(fn, c, 1, {"BIT_DEQUANT": True, dp4a.FLAG: True})
                                for c in dp4a.configs_to_time(gemv, config, K)]
        _chosen[key] = _fastest(choices, M, N, K, x, args, extra)
    fn, config, block_m, flags = _chosen[key]
    return run_choice(fn, config, block_m, M, N, K, x, args, {**extra, **flags})


def chosen(weights: str, M: int, N: int, K: int) -> tuple | None:
    """(kernel function, config, BLOCK_M, flags) the launcher keeps for an "int8" / "int4" layer of
    this shape, if it has launched one (config None: dequantize + cuBLAS); `run_choice` takes the first
    three back, the flags merged into its keyword arguments."""
    for (name, bucket, batch1, n, k, *_), choice in _chosen.items():
        if name == f"_{weights}_kernel" and (bucket, batch1, n, k) == (_m_bucket(M, weights == "int4"), M == 1, N, K):
            return choice
    return None


def _kernel_name(fn) -> str:
    return fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__  # a Triton JITFunction, or a function


def run_choice(fn, config, block_m: int, M: int, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict,
               warmup: bool = False):
    """One call of a choice; `warmup`: compile its Triton kernel without launching it.  With the
    GATED flag (triton_gemv.py) the output is N / 2 wide: silu(gate) * up of the two halves."""
    group = [extra["GROUP"]] if "GROUP" in extra else []
    if config is None:  # dequantize + cuBLAS
        return None if warmup else fn(*args, *group)
    if fn in (wgmma.int8_wgmma_mm, wgmma.int4_wgmma_mm):  # launched by their own module, config and all
        return fn(*args, *group, config, warmup=warmup)
    meta = config.kwargs
    split = meta["SPLIT_K"]
    out, part = splits.buffers(M, N, split, x, bool(extra.get("GATED")))
    grid, raster = tiled_grid(fn, M, N, block_m, meta["BLOCK_N"], split, extra)
    call = (*args, part, M, N, K, _block_m(M), x.stride(0), part.stride(0))
    options = {"BLOCK_M": block_m, **meta, **extra, **raster, "num_warps": config.num_warps,
               "num_stages": config.num_stages, **dependent_launch.launch_options(fn, x.device)}
    if warmup:
        splits.add_splits(part, out, split, warmup=True)
        return fn.warmup(*call, grid=grid, **options)
    fn[grid](*call, **options)
    splits.add_splits(part, out, split)
    return out


@torch.library.custom_op("quantserve::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp16, weight int8 [N, K], scales [N] -> [M, N] in x's dtype."""
    x = x.contiguous()
    return _launch(int8_kernel, x.shape[0], weight.shape[0], x, (x, weight, scales), gemv=int8_gemv_kernel,
                   dense=_int8_dense, prompt=int8_prompt_kernel)


@int8_weight_mm.register_fake
def _(x, weight, scales):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("quantserve::int4_weight_mm", mutates_args=())
def int4_weight_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """x [M, K] fp16, packed uint8 [N, K/2], scales/mins [N, K/group] -> [M, N] in x's dtype.
    Dequantization: w = q * scale + min, q in 0..15."""
    x = x.contiguous()
    return _launch(int4_kernel, x.shape[0], packed.shape[0], x, (x, packed, scales, mins), gemv=int4_gemv_kernel,
                   dense=_int4_dense, prompt=int4_prompt_kernel, rows=int4_rows_kernel, GROUP=group_size)


@int4_weight_mm.register_fake
def _(x, packed, scales, mins, group_size):
    return x.new_empty((x.shape[0], packed.shape[0]))
