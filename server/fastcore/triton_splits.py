"""Where a weight kernel's result goes: straight into the output in x's dtype, or, with K split
over SPLIT_K programs, each split's partial sums apart in fp32, added afterwards in split order.

Skinny layers (the 8B model's down projection: N = 4096 outputs, K = 14336) give too few output
tiles to keep every multiprocessor busy, so the tiled kernels (triton_mm.py) may split K.  The
splits' sums used to be added atomically into a zeroed fp32 buffer, in whatever order the blocks
finished: one request's greedy reply could differ from one run to the next (bench/RESULTS.md,
2026-12-06), and a zero-fill and a cast kernel ran around each such matmul.  Now each split
stores its own rows of an fp32 [SPLIT_K * M, N] buffer (`store_tile`, `store_row`) and one small
kernel adds them in a fixed order and casts (`add_splits`): the same bits on every run, and one
kernel instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # _add_splits: elements a program


@triton.jit
def store_tile(out_ptr, acc, rm, rn, M, N, stride_om, SPLIT_K: tl.constexpr, SWAP: tl.constexpr):
    """A tiled kernel's tile: acc is [BM, BN], or [BN, BM] when it computed the transposed product."""
    if SWAP:
        ptrs = out_ptr + rm[None, :] * stride_om + rn[:, None]
        mask = (rm[None, :] < M) & (rn[:, None] < N)
    else:
        ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # this split's rows [split * M, (split + 1) * M) of the fp32 buffer
        tl.store(ptrs + tl.program_id(1) * M * stride_om, acc, mask=mask)


@triton.jit
def store_row(out_ptr, acc, rn, N, SPLIT_K: tl.constexpr):
    """A batch-1 kernel's outputs rn (triton_gemv.py): one row of N, one fp32 row a split."""
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        tl.store(out_ptr + tl.program_id(1) * N + rn, acc, mask=rn < N)


@triton.jit
def _add_splits(part_ptr, out_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(part_ptr + offs, mask=offs < size, other=0.0)
    for split in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + split * size + offs, mask=offs < size, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < size)


def buffers(M: int, N: int, split: int, x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, where the kernel writes): out [M, N] in x's dtype ([M, N / 2] for a gated layer), and
    the same tensor without split-K, else the fp32 [split * M, N] buffer of the partial sums."""
    if split > 1 and gated:
        raise ValueError("the gated form pairs gate and up rows after the whole of K: it cannot split K")
    out = torch.empty((M, N // 2 if gated else N), device=x.device, dtype=x.dtype)
    return out, (out if split == 1 else torch.empty((split * M, N), device=x.device, dtype=torch.float32))


def add_splits(part: torch.Tensor, out: torch.Tensor, split: int, warmup: bool = False) -> None:
    """out = the sum of part's `split` slices in split order (nothing to do without split-K);
    `warmup`: compile the kernel without launching it."""
    if split == 1:
        return
    args = (part, out, out.numel(), split, BLOCK)
    if warmup:
        _add_splits.warmup(*args, grid=(1,))
    else:
        _add_splits[(triton.cdiv(out.numel(), BLOCK),)](*args)
