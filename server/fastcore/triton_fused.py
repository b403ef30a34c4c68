"""Batch-1 decode's layers with their element-wise neighbours in the same kernel.

At batch 1 a transformer block's four int8 / int4 matrix-vector kernels (triton_gemv.py) sat
between inductor's element-wise kernels: the RMSNorm before q/k/v and before gate-up, silu(gate)
* up after gate-up, and the residual adds after o and down.  Each of those moves a few KB but
costs a launch and its ramp (~1.5 us on an H200: ~190 of them in a decode step of the 8B shape,
against 129 weight kernels).  The matrix-vector kernels take them in (their NORM, GATED and
RESIDUAL flags), so a Llama block at batch 1 is its four weight kernels, the rotary/cache-write
kernels and the attention; the final norm goes into the vocabulary matmul the same way.

    y = int8_gemv_fused(x, weight, scales, normalize, norm, eps, residual, gated)

computes, for one token, `rmsnorm(x) * norm` (`normalize`; without `norm`, the norm's weight was
folded into the layer: fused.fold_norms), or x, times dequant(weight).T, then silu(gate) * up of
the result's two halves (`gated`: N / 2 wide), then + residual.  The layer's
batch-1 kernel and config are the launcher's choice for its shape (triton_mm._launch); until that
choice is made (the shape's first call, at warm-up), or where the choice is not a matrix-vector
kernel, the same arithmetic runs as separate ops.  model.py reaches these through fused.py, only
for one token on a CUDA GPU; everything else keeps the separate ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from quantserve.server.fastcore import triton_mm
from quantserve.server.fastcore.fused import fold_norms, fused_decode_forms
from quantserve.server.fastcore.triton_gemv import fits as gemv_fits, int4_gemv_kernel, int8_gemv_kernel

_compiled: set = set()  # (kernel, flags, forms) whose fused variants were compiled ahead


def fits(weights: str, K: int) -> bool:
    """Whether a layer of `weights` ("int8", "int4") with K inputs has a matrix-vector kernel to fuse
    into (K in whole blocks of one of its configs)."""
    return gemv_fits(int8_gemv_kernel if weights == "int8" else int4_gemv_kernel, K)


def _separate(x: torch.Tensor, matmul, normalize: bool, norm: Optional[torch.Tensor], eps: float,
              residual: Optional[torch.Tensor], gated: bool) -> torch.Tensor:
    """What the fused kernel computes, as separate ops (model.py's RMSNorm, fused.py's gate)."""
    if normalize:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if norm is not None:
            x = norm * x
    y = matmul(x)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else y + residual


def _fused(weights: str, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict, normalize: bool, norm,
           eps: float, residual, gated: bool) -> torch.Tensor | None:
    """The fused kernel at the shape's batch-1 choice, or None if that choice is not the
    matrix-vector kernel of `weights` ("int8", "int4"), or not made yet."""
    gemv = int8_gemv_kernel if weights == "int8" else int4_gemv_kernel
    choice = triton_mm.chosen(weights, 1, N, K)
    if choice is None or choice[0] is not gemv.fn or choice[1].kwargs["SPLIT_K"] != 1:  # a norm needs all of K
        return None
    fn, config, _, flags = choice
    fused = {**extra, **flags, "norm_ptr": norm, "res_ptr": residual, "eps": eps, "NORM": normalize,
             "NORM_WEIGHT": norm is not None, "GATED": gated, "RESIDUAL": residual is not None}
    _compile_variants(weights, fn, config, N, K, x, args, {**extra, **flags})
    return triton_mm.run_choice(fn, config, 1, 1, N, K, x, args, fused)


def _variants(weights: str, x: torch.Tensor) -> list[dict]:
    """The kernel flags of every fused form the model's layers of `weights` take (fused.py), x
    standing in for the fp16 vectors: the vocabulary layer's norm keeps its weight; the blocks'
    norms were folded into the layers where fused.fold_norms says."""
    forms, folded = fused_decode_forms(weights), fold_norms(weights)
    block_norm = {"NORM": True} if folded else {"NORM": True, "NORM_WEIGHT": True, "norm_ptr": x}
    out = [{"RESIDUAL": True, "res_ptr": x}] if "residual" in forms else []
    if "norm" in forms:
        out += [{"NORM": True, "NORM_WEIGHT": True, "norm_ptr": x}] + ([block_norm] if folded else [])
    if "gate" in forms:
        out.append({**block_norm, "GATED": True} if "norm" in forms else {"GATED": True})
    return out


def _compile_variants(weights: str, fn, config, N: int, K: int, x: torch.Tensor, args: tuple, extra: dict) -> None:
    """The fused forms of this kernel and flags that the model takes, compiled at once, on threads
    (a Triton compile is ~1-2 s; one at a time, a cold start would wait for each in turn).  They
    are not specialized on N and K, so this happens once per kernel, flags and forms asked for."""
    key = (fn, tuple(sorted(extra.items())), fused_decode_forms(weights), fold_norms(weights))
    if key in _compiled:
        return
    _compiled.add(key)
    with triton_mm.compiling_ahead():
        for form in _variants(weights, x):
            triton_mm.run_choice(fn, config, 1, 1, N, K, x, args, {**extra, "eps": 0.0, **form}, warmup=True)


@torch.library.custom_op("quantserve::int8_gemv_fused", mutates_args=())
def int8_gemv_fused(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, normalize: bool,
                    norm: Optional[torch.Tensor], eps: float, residual: Optional[torch.Tensor],
                    gated: bool) -> torch.Tensor:
    """x [1, K] fp16, weight int8 [N, K], scales [N], norm [K] or None (only with normalize),
    residual [1, N] (gated: [1, N / 2]) or None -> [1, N] fp16 ([1, N / 2] gated)."""
    x = x.contiguous()
    N, K = weight.shape
    y = _fused("int8", N, K, x, (x, weight, scales), {}, normalize, norm, eps, residual, gated)
    if y is None:
        y = _separate(x, lambda x: triton_mm.int8_weight_mm(x, weight, scales), normalize, norm, eps, residual,
                      gated)
    return y


@int8_gemv_fused.register_fake
def _(x, weight, scales, normalize, norm, eps, residual, gated):
    return x.new_empty((x.shape[0], weight.shape[0] // (2 if gated else 1)))


@torch.library.custom_op("quantserve::int4_gemv_fused", mutates_args=())
def int4_gemv_fused(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int, normalize: bool, norm: Optional[torch.Tensor], eps: float,
                    residual: Optional[torch.Tensor], gated: bool) -> torch.Tensor:
    """As int8_gemv_fused for a packed int4 layer (uint8 [N, K/2], scales / mins [N, K/group])."""
    x = x.contiguous()
    N, K = packed.shape[0], packed.shape[1] * 2
    y = _fused("int4", N, K, x, (x, packed, scales, mins), {"GROUP": group_size}, normalize, norm, eps,
               residual, gated)
    if y is None:
        y = _separate(x, lambda x: triton_mm.int4_weight_mm(x, packed, scales, mins, group_size), normalize, norm,
                      eps, residual, gated)
    return y


@int4_gemv_fused.register_fake
def _(x, packed, scales, mins, group_size, normalize, norm, eps, residual, gated):
    return x.new_empty((x.shape[0], packed.shape[0] // (2 if gated else 1)))
