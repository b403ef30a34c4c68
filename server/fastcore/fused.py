"""A block's linear layers with the element-wise work next to them: one kernel where it can be.

model.py's Block calls these three instead of writing `linear(norm(x))`, `residual + linear(y)`
and `silu(gate) * up` of `w13(norm(x))` out.  For one token on a CUDA GPU, through a layer whose
batch-1 kernel is our Triton matrix-vector kernel (quant.Int8Linear / Int4Linear `fused_forms`), the
norm, the gate and the residual add run inside that kernel (triton_fused.py): at batch 1 those
element-wise kernels cost more in launches than in bytes.  Everything else (prompts, decode
batches, the CPU, fp16 weights, Gemma's norm offset and sandwich norms, a GELU gate) takes the
separate ops, which inductor fuses among themselves.  Both compute the same function; the fused one in
fp32 throughout instead of rounding to fp16 between the ops.

Which forms, from $QUANTSERVE_FUSED_DECODE (fused_decode_forms): by default the gate and the
residual, and for int8 the norms too, with their weights folded into the layers after them
(fold_norms), so that the kernel only sums x^2 beside its products.

Under torch.compile the choice is made while tracing: a size of 1 is specialized, so the graph of
a one-token step and the graph of any other size each hold one branch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

FUSED_FORMS = ("norm", "gate", "residual")  # what the batch-1 kernels can take in
# by weights: on an H100 at batch 1, one call (bench/RESULTS.md, 2026-12-06, midday), int8 with all
# three (norms folded) 1.032x its gate + residual and 1.051x its separate kernels; int4 with gate +
# residual 1.020x its separate kernels, and with its norms too (their weights loaded beside x: int4
# is not folded) 0.951x its gate + residual
DEFAULT_FUSED_FORMS = {"int8": frozenset(FUSED_FORMS), "int4": frozenset(("gate", "residual"))}


def fused_decode_forms(weights: str) -> frozenset:
    """The fused batch-1 forms for layers of `weights` ("int8", "int4"), from
    $QUANTSERVE_FUSED_DECODE: unset for the default (DEFAULT_FUSED_FORMS), 0 for none, 1 for all
    of FUSED_FORMS, or a comma list of them."""
    value = os.environ.get("QUANTSERVE_FUSED_DECODE")
    if value is None:
        return DEFAULT_FUSED_FORMS.get(weights, frozenset())
    value = value.strip()
    if value in ("", "0"):
        return frozenset()
    if value == "1":
        return frozenset(FUSED_FORMS)
    forms = frozenset(f.strip() for f in value.split(",") if f.strip())
    if forms - set(FUSED_FORMS):
        raise ValueError(f"QUANTSERVE_FUSED_DECODE={value!r}: use 0, 1 or a comma list of {', '.join(FUSED_FORMS)}")
    return forms


def fold_norms(weights: str) -> bool:
    """Whether the RMSNorm weights before the q/k/v and gate-up layers are multiplied into those
    layers' columns before quantizing (weights.py; the norms then scale by 1): with the norm form,
    for int8 only.  The same function on a moved quantization grid: free for int8 (one scale a
    row: top-1 agreement 99.68 % against 99.56 % unfolded), +1.18 % perplexity for int4 (a scale
    per 128 columns: the norm's weight spreads a group's range), on the default model
    (bench/RESULTS.md, 2026-12-06)."""
    return weights == "int8" and "norm" in fused_decode_forms(weights)


def norm_args(norm) -> tuple[bool, torch.Tensor | None, float]:
    """What the fused kernels take of the RMSNorm before a layer (model.RMSNorm, or None for
    none): (normalize, the weight x is multiplied by, or None where it was folded into the layer,
    eps)."""
    if norm is None:
        return False, None, 0.0
    return True, None if norm.folded else norm.weight, norm.eps


def _takes(linear, x: torch.Tensor, form: str) -> bool:
    """Whether one token through `linear` takes `form` (FUSED_FORMS) into its kernel."""
    return x.shape[0] == 1 and x.is_cuda and form in getattr(linear, "fused_forms", ())


def norm_linear(norm, linear, x: torch.Tensor) -> torch.Tensor:
    """linear(norm(x)) for an RMSNorm `norm` (model.RMSNorm)."""
    if norm.offset == 0 and _takes(linear, x, "norm"):
        return linear.fused(x, norm=norm)
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
        return linear.fused(x, norm=norm, gated=True)
    return linear.fused(norm(x), gated=True)
