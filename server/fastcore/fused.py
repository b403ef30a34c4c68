"""A block's linear layers with the element-wise work next to them: one kernel where it can be.

model.py's Block calls these three instead of writing `linear(norm(x))`, `residual + linear(y)`
and `silu(gate) * up` of `w13(norm(x))` out.  For one token on a CUDA GPU, through a layer whose
batch-1 kernel is our Triton matrix-vector kernel (quant.Int8Linear / Int4Linear `fused_forms`), the
norm, the gate and the residual add run inside that kernel (triton_fused.py): at batch 1 those
element-wise kernels cost more in launches than in bytes.  Everything else (prompts, decode
batches, the CPU, fp16 weights, Gemma's norm offset and sandwich norms, a GELU gate) takes the
separate ops, which inductor fuses among themselves.  Both compute the same function; the fused one in
fp32 throughout instead of rounding to fp16 between the ops.  Opt-in, each form on its own
($QUANTSERVE_FUSED_DECODE=1 or e.g. gate,residual; quant.fused_decode_forms): on an H100 the three
together were slower than the separate kernels.

Under torch.compile the choice is made while tracing: a size of 1 is specialized, so the graph of
a one-token step and the graph of any other size each hold one branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _takes(linear, x: torch.Tensor, form: str) -> bool:
    """Whether one token through `linear` takes `form` (quant.FUSED_FORMS) into its kernel."""
    return x.shape[0] == 1 and x.is_cuda and form in getattr(linear, "fused_forms", ())


def norm_linear(norm, linear, x: torch.Tensor) -> torch.Tensor:
    """linear(norm(x)) for an RMSNorm `norm` (model.RMSNorm)."""
    if norm.offset == 0 and _takes(linear, x, "norm"):
        return linear.fused(x, norm=norm.weight, eps=norm.eps)
    return linear(norm(x))


def linear_add(linear, x: torch.Tensor, residual: torch.Tensor, post_norm=None) -> torch.Tensor:
    """residual + linear(x), or residual + post_norm(linear(x)) (Gemma 2's sandwich)."""
    if post_norm is None and _takes(linear, x, "residual"):
        return linear.fused(x, residual=residual)
    y = linear(x)
    return residual + (y if post_norm is None else post_norm(y))


def norm_gated_linear(norm, linear, x: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up, where gate and up are the two halves of linear(norm(x)) (the gated MLP's
    gate-up layer); act is silu, or GELU (tanh) for Gemma."""
    if gelu or not _takes(linear, x, "gate"):
        gate, up = norm_linear(norm, linear, x).chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    if norm.offset == 0 and _takes(linear, x, "norm"):
        return linear.fused(x, norm=norm.weight, eps=norm.eps, gated=True)
    return linear.fused(norm(x), gated=True)
