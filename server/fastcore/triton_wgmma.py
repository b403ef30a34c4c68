"""Prompt-sized int8 / int4 weight matmuls for sm_90 (H100 / H200): y[M, N] = x[M, K] @ dequant(W)[N, K].T
with the weight tiles dequantized in registers as wgmma's first operand, never written as fp16.

The prompt path elsewhere (triton_mm.py) either writes an fp16 copy of each weight and hands it to
cuBLAS, or runs 128-row tiles whose operands are plain pointer loads.  Here both operands arrive by
TMA (tensor descriptors) into a ring of shared-memory stages, so the loads run ahead of the math;
the weight tile is read from shared memory into registers, converted (int8: 1152 + w as fp16 bits,
four bytes at a time; int4: Marlin's nibble trick, then q * s + z per group) and fed to wgmma from
registers.  The kernel computes y.T = W @ x.T, so the weight is the first operand, the one wgmma
takes from registers; x, the second, stays in shared memory as TMA wrote it.

Tiles walk their row tiles first: the programs that share a weight tile run side by side and read it
from HBM once.  Rows past M are zeros from TMA (no masks in the K loop); the store masks them.

Only for sm_90+: below it Triton has no wgmma (sm_80: mma.sync; a T4, sm_75: FMAs), and TMA needs
sm_90.  `usable(x)` says whether a call may take this path; the launcher times it against the others.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import (dequantize_int4, dequantize_int8, int8_pairs_to_fp16,
                                                       int8s_to_fp16, nibbles_to_fp16)


# Candidates timed per shape (a few: each is one Triton compile at start-up): BLOCK_N weight rows
# (multiples of 64: one warpgroup's wgmma height), BLOCK_M prompt rows, BLOCK_K deep, warps, stages.
# The ones that won some layer of the 8B / 1B at 256-2,048 rows on an H100 (bench/RESULTS.md,
# 2026-12-07); 256 x 128 tiles, and 128 x 128 x 64, never did.
_SHAPES = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4))
# ... and these with TAIL (_parts: a last partial wave of tiles in tiles half as wide)
_TAIL_SHAPES = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4))
# more that bench/kernel_race.py times beside them (not the launcher: each is a compile at start-up)
_MORE_SHAPES = ((128, 128, 64, 8, 4), (64, 256, 128, 4, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 5),
                (64, 256, 64, 4, 5), (128, 128, 64, 4, 4), (64, 256, 64, 8, 4))


def _configs(shapes, **flags) -> tuple:
    return tuple(triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, **flags}, num_warps=warps,
                               num_stages=stages) for bn, bm, bk, warps, stages in shapes)


CONFIGS, MORE_CONFIGS = _configs(_SHAPES) + _configs(_TAIL_SHAPES, TAIL=True), _configs(_MORE_SHAPES)


def fits(config: triton.Config, K: int, group: int | None = None) -> bool:
    """Whether `config` serves K columns (whole K tiles, each inside one int4 group)."""
    bk = config.kwargs["BLOCK_K"]
    return K % bk == 0 and (group is None or group % bk == 0)


def configs_for(K: int, group: int | None = None, more: bool = False, pairs: bool = False) -> list[triton.Config]:
    """The configs for K columns (int4: in groups of `group`; more: MORE_CONFIGS too; pairs: int8's,
    each also with its weight read as int16 pairs, PAIRS)."""
    kept = [c for c in CONFIGS + (MORE_CONFIGS if more else ()) if fits(c, K, group)]
    return kept + ([_with_pairs(c) for c in kept] if pairs else [])


def _with_pairs(c: triton.Config) -> triton.Config:
    return triton.Config({**c.kwargs, "PAIRS": True}, num_warps=c.num_warps, num_stages=c.num_stages)


def available() -> bool:
    """Whether this process's GPU runs these kernels (sm_90 or later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def usable(x: torch.Tensor) -> bool:
    """Whether x may take this path: x row-major with 16-byte rows and base (TMA's rules), fp16 or
    bf16, on a CUDA GPU of sm_90 or later (or in Triton's interpreter, which emulates TMA)."""
    gpu = (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)) or INTERPRETED
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if INTERPRETED else ())
    return (gpu and x.dim() == 2 and x.dtype in dtypes and x.stride(1) == 1
            and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _tile(tile, M, N0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first output row, first prompt row) of this program's tile: row tiles first, outputs from N0."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    return N0 + tile // m_tiles * BLOCK_N, tile % m_tiles * BLOCK_M


@triton.jit
def _store(out_ptr, acc, rn, rm, M, N, stride_om):
    # acc [BLOCK_N, BLOCK_M] is y.T's tile; y is [M, N] row-major.
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _as_float(w, BIT_DEQUANT: tl.constexpr):
    """An int8 tile as fp16 (a float weight as it is: the same tiles unconverted, bench's baseline)."""
    out = w
    if w.dtype == tl.int8:
        if BIT_DEQUANT:
            out = int8s_to_fp16(w)
        else:
            out = w.to(tl.float16)
    return out


@triton.jit(do_not_specialize=["M", "N0"])
def _int8_wgmma_kernel(x_desc, w_desc, s_ptr, out_ptr, M, N, N0, K, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BIT_DEQUANT: tl.constexpr = True, PAIRS: tl.constexpr = False):
    # PAIRS: w_desc is the int8 weight seen as int16 [N, K/2], two columns a value, split into the
    # even and odd columns and interleaved back (as int4's nibbles are): a config's choice.
    n0, m0 = _tile(tl.program_id(0), M, N0, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([m0, k])  # [BM, BK]
        if PAIRS:
            even, odd = int8_pairs_to_fp16(w_desc.load([n0, k // 2]))  # [BN, BK / 2] each
            w = tl.interleave(even, odd)
        else:
            w = _as_float(w_desc.load([n0, k]), BIT_DEQUANT)  # int8 [BN, BK]
        acc = tl.dot(w.to(x.dtype), x.T, acc)
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = m0 + tl.arange(0, BLOCK_M)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)  # one per output: applied once
    _store(out_ptr, acc * scale[:, None], rn, rm, M, N, stride_om)


@triton.jit(do_not_specialize=["M", "N0"])
def _int4_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, M, N, N0, K, stride_om, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BIT_DEQUANT: tl.constexpr = True):
    # w_desc: uint8 [N, K/2], column 2j in the high nibble of byte j, 2j + 1 in the low one.  A K tile
    # lies inside one group, so each row has one scale and one offset per step: the tile becomes
    # q * s + z in fp16 (one FMA a weight, paid once per BLOCK_M rows) before wgmma.
    n0, m0 = _tile(tl.program_id(0), M, N0, BLOCK_M, BLOCK_N)
    rn = n0 + tl.arange(0, BLOCK_N)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        packed = w_desc.load([n0, k // 2])  # [BN, BK / 2]
        x = x_desc.load([m0, k])
        s = tl.load(s_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        z = tl.load(z_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        hi, lo = nibbles_to_fp16(packed, BIT_DEQUANT)
        w = tl.interleave(hi, lo).to(x.dtype) * s[:, None] + z[:, None]
        acc = tl.dot(w, x.T, acc)
    rm = m0 + tl.arange(0, BLOCK_M)
    _store(out_ptr, acc, rn, rm, M, N, stride_om)


def _launch(kernel, x: torch.Tensor, w: torch.Tensor, args: tuple, N: int, config: triton.Config, w_block_k: int,
            warmup: bool, extra: dict):
    """One launch of `kernel` over every tile, or with TAIL two (_parts)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    meta = {k: v for k, v in config.kwargs.items() if k != "TAIL"}
    for n0, bn, warps in _parts(M, N, config, _multiprocessors(x)):
        bm, bk = meta["BLOCK_M"], meta["BLOCK_K"]
        call = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, w_block_k]),
                *args, out, M, N, n0, K, out.stride(0))
        options = {**meta, "BLOCK_N": bn, **extra, "num_warps": warps, "num_stages": config.num_stages}
        if warmup:  # compile only (triton_dequant.compiling_ahead runs it on a thread)
            kernel.warmup(*call, grid=(1,), **options)
        else:
            kernel[(triton.cdiv(M, bm) * triton.cdiv(N - n0, bn),)](*call, **options)
    return None if warmup else out


def _parts(M: int, N: int, config: triton.Config, multiprocessors: int) -> list[tuple[int, int, int]]:
    """(first output row, BLOCK_N, warps) of each launch.  With TAIL, the tiles that fill whole waves
    of the GPU (one tile per multiprocessor at a time: these tiles take all of one's shared memory)
    are one launch, and the outputs left, a last partial wave, a second one in tiles half as wide,
    so that wave takes half as long: the 8B's gate_up at 512 rows is 448 tiles of 128 x 256 on 132
    multiprocessors, 3.4 waves that ran as 4."""
    bm, bn, warps = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps
    if not config.kwargs.get("TAIL"):
        return [(0, bn, warps)]
    m_tiles, n_tiles = triton.cdiv(M, bm), triton.cdiv(N, bn)
    head = m_tiles * n_tiles // multiprocessors * multiprocessors // m_tiles  # weight tiles in whole waves
    if head == 0 or head >= n_tiles:
        return [(0, bn, warps)]
    return [(0, bn, warps), (head * bn, bn // 2, max(4, warps // 2))]


def _multiprocessors(x: torch.Tensor) -> int:
    # the interpreter (CPU tests) pretends to 4, so that a small layer already splits
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


def int8_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, config: triton.Config,
                  warmup: bool = False, bit_dequant: bool = True) -> torch.Tensor:
    """x [M, K] @ (weight int8 [N, K] * scales [N]).T on one config (`warmup`: compile it, no launch;
    config PAIRS: the weight read as int16 pairs).  Where x cannot take this path (`usable`),
    dequantize-then-cuBLAS computes the same."""
    if not usable(x):
        return None if warmup else torch.mm(x, dequantize_int8(weight, scales, x.dtype).t())
    if config.kwargs.get("PAIRS"):
        return _launch(_int8_wgmma_kernel, x, weight.view(torch.int16), (scales,), weight.shape[0], config,
                       config.kwargs["BLOCK_K"] // 2, warmup, {})
    return _launch(_int8_wgmma_kernel, x, weight, (scales,), weight.shape[0], config, config.kwargs["BLOCK_K"], warmup,
                   {"BIT_DEQUANT": bit_dequant})


def float_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, config: triton.Config) -> torch.Tensor:
    """x @ weight.T for a float weight on the same tiles, nothing converted: what the tiles cost
    without their dequantization (kernel_race's fp16-wgmma)."""
    return int8_wgmma_mm(x, weight, torch.ones(weight.shape[0], device=x.device, dtype=x.dtype), config)


def int4_wgmma_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                  config: triton.Config, warmup: bool = False, bit_dequant: bool = True) -> torch.Tensor:
    """x [M, K] @ (q * scales + mins).T, q the nibbles of packed uint8 [N, K/2], one scale / min per
    group (as int8_wgmma_mm otherwise)."""
    if not usable(x):
        return None if warmup else torch.mm(x, dequantize_int4(packed, scales, mins, group, x.dtype).t())
    return _launch(_int4_wgmma_kernel, x, packed, (scales, mins), packed.shape[0], config,
                   config.kwargs["BLOCK_K"] // 2, warmup, {"GROUP": group, "BIT_DEQUANT": bit_dequant})


# what a kept choice's config may set (kernel_choices): the kernel's parameters and the launch's own
int8_wgmma_mm.jit_kernel, int4_wgmma_mm.jit_kernel = _int8_wgmma_kernel, _int4_wgmma_kernel
int8_wgmma_mm.launch_options = int4_wgmma_mm.launch_options = {"TAIL"}
