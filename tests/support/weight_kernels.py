"""Layers, references and bounds the weight-kernel tests share (test_gpu_kernels.py on a GPU,
test_gemv_forms.py on a GPU or in Triton's interpreter)."""

from __future__ import annotations

import torch


def layers(N: int, K: int, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.float16):
    """An int8 and an int4 (group 128) layer of one random [N, K] weight, made by the plain torch
    quantizer (the kernels under test read the same buffers)."""
    from quantserve.server.fastcore.quant import make_linear

    torch.manual_seed(seed)
    w = torch.randn(N, K, device=device, dtype=dtype) * 0.02
    return make_linear(w, None, "int8", dtype, "torch"), make_linear(w, None, "int4", dtype, "torch")


def reference(layer, x: torch.Tensor) -> torch.Tensor:
    """x @ dequant(W).T in fp32 from the layer's own integers and scales."""
    if hasattr(layer, "mins"):
        w = layer.dequantize(torch.float32)
    else:
        w = layer.weight.float() * layer.scales.float()[:, None]
    return x.float() @ w.t()


def fused_reference(layer, x: torch.Tensor, normalize: bool, norm: torch.Tensor | None, eps: float, gated: bool,
                    residual: torch.Tensor | None) -> torch.Tensor:
    """What a fused kernel computes, in fp32 from the layer's own integers: x RMS-normalized
    (normalize) and times the norm's weight (norm given; None: folded into the layer), the matmul,
    silu(gate) * up of its halves (gated), plus the residual."""
    xf = x.float()
    if normalize:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if norm is not None:
            xf = norm.float() * xf
    y = reference(layer, xf)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y if residual is None else y + residual.float()


def check(y: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 2e-3, dtype=torch.float16) -> None:
    """y (the kernel's output, in x's dtype) within `rel` of the reference's largest value."""
    assert y.shape == ref.shape and y.dtype == dtype, (what, y.shape, ref.shape, y.dtype)
    err = (y.float() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item() + 1e-3, (what, err, ref.abs().max().item())


# the batch-1 variants: fp32 products of the bit trick's offset integers (1152 + b, 1024 + q) or of
# Triton's own conversion; int4's packed fp16 products (HALF_DOT: each product and each lane's sum
# of 4 rounded to fp16, ~1e-3 of the output's scale in Triton's interpreter); x rounded to int8 for
# dp4a (DOT4: |x - x̂| <= max|x| / 254 over a word's 4 or 8 columns, ~3-5e-3 of the output's scale);
# each step's weights loaded a step ahead or not (AHEAD, whatever QUANTSERVE_GEMV_AHEAD makes the default)
INT8_VARIANTS = ({"BIT_DEQUANT": True}, {"BIT_DEQUANT": False}, {"BIT_DEQUANT": True, "DOT4": True},
                 *({"BIT_DEQUANT": True, "AHEAD": a} for a in (True, False)),
                 *({"BIT_DEQUANT": True, "DOT4": True, "AHEAD": a} for a in (True, False)))
INT4_VARIANTS = ({"BIT_DEQUANT": True}, {"BIT_DEQUANT": False}, {"BIT_DEQUANT": True, "HALF_DOT": True},
                 {"BIT_DEQUANT": True, "DOT4": True}, *({"BIT_DEQUANT": True, "AHEAD": a} for a in (True, False)),
                 *({"BIT_DEQUANT": True, "DOT4": True, "AHEAD": a} for a in (True, False)))


def bound(flags: dict | None, outliers: bool = False) -> float:
    """The error bound (of the reference's largest value) for a kernel run with `flags`.  With
    `outliers` (x with a few channels ~300x the rest), x rounded to int8 loses most of the columns
    that share a word with an outlier: ~1.5e-2 for int4 in the interpreter.  A GATED form
    (silu(gate) * up) multiplies two outputs' errors: ~1.1e-2 for int4 with DOT4 there."""
    flags = flags or {}
    if flags.get("DOT4"):
        return 3e-2 if outliers or flags.get("GATED") else 1e-2
    return 5e-3 if flags.get("HALF_DOT") else 2e-3


# the fused forms the model uses, as (NORM, NORM_WEIGHT, GATED, RESIDUAL): norm -> qkv / vocabulary,
# norm -> gate-up -> silu(gate) * up (or the gate alone, QUANTSERVE_FUSED_DECODE=gate,...), o / down -> + residual;
# "folded": the norm's weight multiplied into the layer (fused.fold_norms), the kernel normalizes only
FUSED_FORMS = {"norm": (True, True, False, False), "folded norm": (True, False, False, False),
               "norm+gated": (True, True, True, False), "folded norm+gated": (True, False, True, False),
               "gated": (False, False, True, False), "residual": (False, False, False, True)}
