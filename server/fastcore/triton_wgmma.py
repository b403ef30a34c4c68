"""Prompt-sized int8 / int4 weight matmuls for sm_90 (H100 / H200): y[M, N] = x[M, K] @ dequant(W)[N, K].T
with the weight tiles dequantized in registers as wgmma's first operand, never written as fp16.

The prompt path elsewhere (triton_mm.py) either writes an fp16 copy of each weight and hands it to
cuBLAS, or runs 128-row tiles whose operands are plain pointer loads.  Here both operands arrive by
TMA (tensor descriptors) into a ring of shared-memory stages, so the loads run ahead of the math;
the weight tile is read from shared memory into registers, converted (int8: 1152 + w as fp16 bits;
int4: Marlin's nibble trick, then q * s + z per group) and fed to wgmma from registers.  The kernel
computes y.T = W @ x.T, so the weight is the first operand, the one wgmma takes from registers; x,
the second, stays in shared memory as TMA wrote it.

Tiles walk their row tiles first: the programs that share a weight tile run side by side and read it
from HBM once.  Rows past M are zeros from TMA (no masks in the K loop); the store masks them.

Only for sm_90+: below it Triton has no wgmma (sm_80: mma.sync; a T4, sm_75: FMAs), and TMA needs
sm_90.  `usable(x)` says whether a call may take this path; the launcher times it against the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import int8_to, nibbles_to_fp16


@dataclass(frozen=True)
class WgmmaConfig:
    """One tile shape: BLOCK_N weight rows (a multiple of 64: one warpgroup's wgmma height each),
    BLOCK_M prompt rows, BLOCK_K deep, on `warps` warps with `stages` shared-memory stages."""
    block_n: int
    block_m: int
    block_k: int
    warps: int
    stages: int

    def fits(self, N: int, K: int, group: int | None = None) -> bool:
        return K % self.block_k == 0 and (group is None or group % self.block_k == 0)


# Candidates timed per shape (a few: each is one Triton compile at start-up).
CONFIGS = (
    WgmmaConfig(128, 128, 64, 8, 4),
    WgmmaConfig(128, 256, 64, 8, 3),
    WgmmaConfig(128, 256, 64, 8, 4),
    WgmmaConfig(256, 128, 64, 8, 3),
    WgmmaConfig(128, 128, 128, 8, 3),
    WgmmaConfig(64, 256, 64, 4, 4),
    WgmmaConfig(128, 64, 64, 4, 5),
)


def usable(x: torch.Tensor) -> bool:
    """Whether x may take this path: a CUDA GPU of sm_90 or later, x row-major with 16-byte rows and
    base (TMA's rules), fp16 or bf16."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0) and x.dim() == 2
            and x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1
            and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0)


@triton.jit
def _tile(tile, M, BLOCK_M: tl.constexpr):
    m_tiles = tl.cdiv(M, BLOCK_M)
    return tile // m_tiles, tile % m_tiles  # (weight tile, row tile): row tiles first


@triton.jit
def _store(out_ptr, acc, rn, rm, M, N, stride_om):
    # acc [BLOCK_N, BLOCK_M] is y.T's tile; y is [M, N] row-major.
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _int8_wgmma_kernel(x_desc, w_desc, s_ptr, out_ptr, M, N, K, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BIT_DEQUANT: tl.constexpr = True):
    pid_n, pid_m = _tile(tl.program_id(0), M, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k])  # int8 [BN, BK]
        x = x_desc.load([pid_m * BLOCK_M, k])  # [BM, BK]
        if w.dtype == tl.int8:
            w = int8_to(w, x.dtype, BIT_DEQUANT)
        acc = tl.dot(w.to(x.dtype), x.T, acc)  # (a float weight: the same tiles unconverted, bench's baseline)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)  # one per output: applied once
    _store(out_ptr, acc * scale[:, None], rn, rm, M, N, stride_om)


@triton.jit(do_not_specialize=["M"])
def _int4_wgmma_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, M, N, K, stride_om, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BIT_DEQUANT: tl.constexpr = True):
    # w_desc: uint8 [N, K/2], column 2j in the high nibble of byte j, 2j + 1 in the low one.  A K tile
    # lies inside one group, so each row has one scale and one offset per step: the tile becomes
    # q * s + z in fp16 (one FMA a weight, paid once per BLOCK_M rows) before wgmma.
    pid_n, pid_m = _tile(tl.program_id(0), M, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = K // GROUP
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        packed = w_desc.load([pid_n * BLOCK_N, k // 2])  # [BN, BK / 2]
        x = x_desc.load([pid_m * BLOCK_M, k])
        s = tl.load(s_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        z = tl.load(z_ptr + rn * groups + k // GROUP, mask=rn < N, other=0.0).to(x.dtype)
        hi, lo = nibbles_to_fp16(packed, BIT_DEQUANT)
        w = tl.interleave(hi, lo).to(x.dtype) * s[:, None] + z[:, None]
        acc = tl.dot(w, x.T, acc)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    _store(out_ptr, acc, rn, rm, M, N, stride_om)


def _descriptors(x: torch.Tensor, w: torch.Tensor, config: WgmmaConfig, w_block_k: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(w, [config.block_n, w_block_k]))


def _grid(M: int, N: int, config: WgmmaConfig) -> tuple:
    return (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)


def int8_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, config: WgmmaConfig,
                  bit_dequant: bool = True) -> torch.Tensor:
    """x [M, K] @ (weight int8 [N, K] * scales [N]).T on one config."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    x_desc, w_desc = _descriptors(x, weight, config, config.block_k)
    _int8_wgmma_kernel[_grid(M, N, config)](x_desc, w_desc, scales, out, M, N, K, out.stride(0),
                                            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                            BIT_DEQUANT=bit_dequant, num_warps=config.warps, num_stages=config.stages)
    return out


def float_wgmma_mm(x: torch.Tensor, weight: torch.Tensor, config: WgmmaConfig) -> torch.Tensor:
    """x @ weight.T for a float weight on the same tiles, nothing converted: what the tiles cost
    without their dequantization (kernel_race's fp16-wgmma)."""
    return int8_wgmma_mm(x, weight, torch.ones(weight.shape[0], device=x.device, dtype=x.dtype), config)


def int4_wgmma_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                  config: WgmmaConfig, bit_dequant: bool = True) -> torch.Tensor:
    """x [M, K] @ (q * scales + mins).T, q the nibbles of packed uint8 [N, K/2], one scale / min per group."""
    M, K = x.shape
    N = packed.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    x_desc, w_desc = _descriptors(x, packed, config, config.block_k // 2)
    _int4_wgmma_kernel[_grid(M, N, config)](x_desc, w_desc, scales, mins, out, M, N, K, out.stride(0), GROUP=group,
                                            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                            BIT_DEQUANT=bit_dequant, num_warps=config.warps, num_stages=config.stages)
    return out
