"""Prompt-sized int8 / int4 weight matmuls for sm_90 (H100 / H200): y[M, N] = x[M, K] @ dequant(W)[N, K].T
with the weight tiles dequantized in registers as wgmma's first operand, never written as fp16.

The prompt path elsewhere (triton_mm.py) either writes an fp16 copy of each weight and hands it to
cuBLAS, or runs 128-row tiles whose operands are plain pointer loads.  Here both operands arrive by
TMA (tensor descriptors) into a ring of shared-memory stages, so the loads run ahead of the math;
the weight tile is read from shared memory into registers, converted (int8: read as int16 pairs,
1152 + w as fp16 bits; int4: Marlin's nibble trick, then q * s + z per group) and fed to wgmma from
registers.  The kernel computes y.T = W @ x.T, so the weight is the first operand, the one wgmma
takes from registers; x, the second, stays in shared memory as TMA wrote it.

Tiles walk their row tiles first: the programs that share a weight tile run side by side and read it
from HBM once.  Rows past M are zeros from TMA (no masks in the K loop); the store masks them.

Only for sm_90+: below it Triton has no wgmma (sm_80: mma.sync; a T4, sm_75: FMAs), and TMA needs
sm_90.  `usable(x)` says whether a call may take this path; the launcher times it against the others.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import (dequantize_int4, dequantize_int8, int8_pairs_to_fp16,
                                                       nibbles_to_fp16)


# Candidates timed per shape (a few: each is one Triton compile at start-up): BLOCK_N weight rows
# (multiples of 64: one warpgroup's wgmma height), BLOCK_M prompt rows, BLOCK_K deep, warps, stages.
# The ones that won some layer of the 8B at 256-2,048 rows on an H100 (bench/RESULTS.md, 2026-12-07).
_SHAPES = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
           (64, 256, 128, 4, 3),
           # small enough for two programs a multiprocessor (107 KB of shared memory, 165 registers a
           # thread in the sm_90 build), so one's conversions and stores can overlap the other's
           # wgmma: it won int4's qkv at 512 rows on an H100 (bench/RESULTS.md, 2026-12-07 evening)
           (64, 256, 64, 4, 3))
# Not among them: persistent configs (one program per multiprocessor walking tiles, their K loops
# flattened into one by tl.range(..., flatten=True)).  On an H200 they took 1.6-1.8x the time of the
# same tiles one program a tile, on every 8B layer at 512 rows (bench/RESULTS.md, 2026-12-07).

# more that bench/kernel_race.py times beside them (not the launcher: each is a compile at start-up).
# None won a layer there but 64 x 128 x 64 on 3 stages (57 KB of shared memory), int8's
# qkv at 512 rows in the race of 2026-12-07 evening (50.5 against 56.3 us); it joins the launcher's
# configs once its GPU test (test_every_wgmma_prompt_config, which runs these too) has passed
_MORE_SHAPES = ((128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 5), (64, 256, 64, 4, 5),
                (128, 128, 64, 4, 4), (64, 256, 64, 8, 4), (64, 256, 64, 4, 2), (64, 128, 128, 4, 2),
                (64, 128, 64, 4, 3))


def _configs(shapes) -> tuple:
    return tuple(triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
                 for bn, bm, bk, warps, stages in shapes)


CONFIGS, MORE_CONFIGS = _configs(_SHAPES), _configs(_MORE_SHAPES)


def fits(config: triton.Config, K: int, group: int | None = None) -> bool:
    """Whether `config` serves K columns (whole K tiles, each inside one int4 group)."""
    bk = config.kwargs["BLOCK_K"]
    return K % bk == 0 and (group is None or group % bk == 0)


def configs_for(K: int, group: int | None = None, more: bool = False) -> list[triton.Config]:
    """The configs for K columns (int4: in groups of `group`; more: MORE_CONFIGS too)."""
    return [c for c in CONFIGS + (MORE_CONFIGS if more else ()) if fits(c, K, group)]


def available() -> bool:
    """Whether this process's GPU and Triton run these kernels (sm_90 or later; tensor descriptors)."""
    return torch.cuda.is_available() and _runs_on(torch.cuda.current_device())


def _runs_on(device) -> bool:
    return TENSOR_DESCRIPTORS and torch.cuda.get_device_capability(device) >= (9, 0)


def usable(x: torch.Tensor) -> bool:
    """Whether x may take this path: x row-major with 16-byte rows and base (TMA's rules), fp16 or
    bf16, on a CUDA GPU of sm_90 or later (or in Triton's interpreter, which emulates TMA), with a
    Triton that has tensor descriptors."""
    gpu = (x.is_cuda and _runs_on(x.device)) or (INTERPRETED and TENSOR_DESCRIPTORS)
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if INTERPRETED else ())
    return (gpu and x.dim() == 2 and x.dtype in dtypes and x.stride(1) == 1
            and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# host-side tensor descriptors (TMA) came with Triton 3.3: an older Triton leaves this path out
TENSOR_DESCRIPTORS = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


@triton.jit
def _tile(tile, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first output row, first prompt row) of this program's tile: row tiles first."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    return tile // m_tiles * BLOCK_N, tile % m_tiles * BLOCK_M


@triton.jit
def _store(out_ptr, acc, rn, rm, M, N, stride_om):
    # acc [BLOCK_N, BLOCK_M] is y.T's tile; y is [M, N] row-major.
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _int8_wgmma_kernel(x_desc, w_desc, s_ptr, out_ptr, M, N, K, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS: tl.constexpr):
    # PAIRS: w_desc is the int8 weight seen as int16 [N, K/2], two columns a value, split into the
    # even and odd columns and interleaved back, as int4's nibbles are.  Read as int8 and converted
    # four bytes at a time it took 1.1-1.2x longer on an H100 (bench/RESULTS.md, 2026-12-07): in the
    # layout wgmma wants, a thread's four bytes are not one word, and Triton assembled each with prmt.
    # Without PAIRS, w_desc is a float weight used as it is (kernel_race's fp16-wgmma baseline).
    n0, m0 = _tile(tl.program_id(0), M, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([m0, k])  # [BM, BK]
        if PAIRS:
            even, odd = int8_pairs_to_fp16(w_desc.load([n0, k // 2]))  # [BN, BK / 2] each
            w = tl.interleave(even, odd)
        else:
            w = w_desc.load([n0, k])
        acc = tl.dot(w.to(x.dtype), x.T, acc)
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = m0 + tl.arange(0, BLOCK_M)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)  # one per output: applied once
    _store(out_ptr, acc * scale[:, None], rn, rm, M, N, stride_om)


@triton.jit(do_not_specialize=["M"])
def _int4_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, M, N, K, stride_om, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # w_desc: uint8 [N, K/2], column 2j in the high nibble of byte j, 2j + 1 in the low one.  A K tile
    # lies inside one group, so each row has one scale and one offset per step: the tile becomes
    # q * s + z in fp16 (one FMA a weight, paid once per BLOCK_M rows) before wgmma.
    n0, m0 = _tile(tl.program_id(0), M, BLOCK_M, BLOCK_N)
    rn = n0 + tl.arange(0, BLOCK_N)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        packed = w_desc.load([n0, k // 2])  # [BN, BK / 2]
        x = x_desc.load([m0, k])
        s = tl.load(s_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        z = tl.load(z_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        hi, lo = nibbles_to_fp16(packed, True)
        w = tl.interleave(hi, lo).to(x.dtype) * s[:, None] + z[:, None]
        acc = tl.dot(w, x.T, acc)
    rm = m0 + tl.arange(0, BLOCK_M)
    _store(out_ptr, acc, rn, rm, M, N, stride_om)


def _launch(kernel, x: torch.Tensor, w: torch.Tensor, args: tuple, N: int, config: triton.Config, w_block_k: int,
            warmup: bool, extra: dict):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    call = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, w_block_k]), *args,
            out, M, N, K, out.stride(0))
    options = {**config.kwargs, **extra, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if warmup:  # compile only (triton_dequant.compiling_ahead runs it on a thread)
        return kernel.warmup(*call, grid=(1,), **options)
    kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](*call, **options)
    return out


def int8_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, config: triton.Config,
                  warmup: bool = False) -> torch.Tensor:
    """x [M, K] @ (weight int8 [N, K] * scales [N]).T on one config (`warmup`: compile it, no launch).
    Where x cannot take this path (`usable`), dequantize-then-cuBLAS computes the same."""
    if not usable(x):
        return None if warmup else torch.mm(x, dequantize_int8(weight, scales, x.dtype).t())
    return _launch(_int8_wgmma_kernel, x, weight.view(torch.int16), (scales,), weight.shape[0], config,
                   config.kwargs["BLOCK_K"] // 2, warmup, {"PAIRS": True})


def float_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, config: triton.Config) -> torch.Tensor:
    """x @ weight.T for a float weight on the same tiles, nothing converted: what the tiles cost
    without their dequantization (kernel_race's fp16-wgmma)."""
    ones = torch.ones(weight.shape[0], device=x.device, dtype=x.dtype)
    return _launch(_int8_wgmma_kernel, x, weight, (ones,), weight.shape[0], config, config.kwargs["BLOCK_K"], False,
                   {"PAIRS": False})


def int4_wgmma_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                  config: triton.Config, warmup: bool = False) -> torch.Tensor:
    """x [M, K] @ (q * scales + mins).T, q the nibbles of packed uint8 [N, K/2], one scale / min per
    group (as int8_wgmma_mm otherwise)."""
    if not usable(x):
        return None if warmup else torch.mm(x, dequantize_int4(packed, scales, mins, group, x.dtype).t())
    return _launch(_int4_wgmma_kernel, x, packed, (scales, mins), packed.shape[0], config,
                   config.kwargs["BLOCK_K"] // 2, warmup, {"GROUP": group})


# what a kept choice's config may set (kernel_choices): their kernel's parameters
int8_wgmma_mm.jit_kernel, int4_wgmma_mm.jit_kernel = _int8_wgmma_kernel, _int4_wgmma_kernel
