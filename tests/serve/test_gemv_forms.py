"""The batch-1 matrix-vector kernels in each form a decode step runs them (fastcore/fused.py: the
norm taken in, silu(gate) * up paired after gate-up, the residual added; int4's packed fp16
products; x rounded to int8 for dp4a), every config, against the separate ops in fp32.

On a CUDA GPU the kernels run for real, on an 8B-sized layer.  On a CPU they run in Triton's
interpreter where Triton is installed (the inline PTX bit tricks become the same arithmetic in
Triton ops there), on a small layer (the test extra installs Triton on a CPU machine too; without it:
skipped).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.weight_kernels import FUSED_FORMS, INT4_VARIANTS, INT8_VARIANTS, bound, check, fused_reference, layers

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton", reason="Triton is not installed (a CUDA GPU or the interpreter runs this)")
DEVICE, DTYPE = ("cuda", torch.float16) if CUDA else ("cpu", torch.float32)
# N is not a multiple of any BLOCK_N (the clamped last rows, and for the gate the last pairs); K
# holds whole blocks of every config
N, K = (1000, 4096) if CUDA else (40, 2048)


def _cases(q8, q4, x, norm, eps):
    """(label, kernel, config, args, flags, reference, bound) for every form: each config in the
    default variant, each other variant in the first config."""
    from quantserve.server.fastcore import triton_gemv

    cases = []
    for form, (normed, weighted, gated, added) in FUSED_FORMS.items():
        residual = torch.randn(1, N // 2 if gated else N, device=DEVICE, dtype=DTYPE) if added else None
        flags = {"eps": eps, "NORM": normed, "NORM_WEIGHT": weighted, "GATED": gated, "RESIDUAL": added,
                 "norm_ptr": norm if weighted else None, "res_ptr": residual}
        ref8 = fused_reference(q8, x, normed, norm if weighted else None, eps, gated, residual)
        ref4 = fused_reference(q4, x, normed, norm if weighted else None, eps, gated, residual)
        int8, int4 = triton_gemv.int8_gemv_kernel, triton_gemv.int4_gemv_kernel
        for i, variant in enumerate(INT8_VARIANTS):
            cases += [(f"int8 {form} {c} {variant}", int8.fn, c, (x, q8.weight, q8.scales), {**variant, **flags},
                       ref8, bound({**variant, **flags})) for c in (int8.configs if i == 0 else int8.configs[:1])]
        for i, variant in enumerate(INT4_VARIANTS):
            cases += [(f"int4 {form} {c} {variant}", int4.fn, c, (x, q4.weight, q4.scales, q4.mins),
                       {"GROUP": q4.group_size, **variant, **flags}, ref4, bound({**variant, **flags}))
                      for c in (int4.configs if i == 0 else int4.configs[:1])]
    return cases


def test_every_matrix_vector_config_in_every_fused_form():
    from quantserve.server.fastcore import triton_mm

    eps = 1e-5
    q8, q4 = layers(N, K, seed=6, device=DEVICE, dtype=DTYPE)
    torch.manual_seed(6)
    norm = (torch.rand(K, device=DEVICE) + 0.5).to(DTYPE)
    x = (torch.randn(1, K, device=DEVICE) * 2 + 0.3).to(DTYPE)
    cases = _cases(q8, q4, x, norm, eps)
    if CUDA:
        with triton_mm.compiling_ahead():  # ~70 kernels: compiled on threads, as the launcher does
            for _, fn, config, args, flags, _, _ in cases:
                triton_mm.run_choice(fn, config, 1, 1, N, K, x, args, flags, warmup=True)
    for label, fn, config, args, flags, ref, rel in cases:
        check(triton_mm.run_choice(fn, config, 1, 1, N, K, x, args, flags), ref, label, rel, DTYPE)


def test_split_k_with_the_weights_loaded_ahead_or_not():
    """The batch-1 kernels over K split in two and four (a caller may ask; the configs keep 1): each
    split loads its own steps ahead and stops at its own end.  Loading ahead changes when the words
    arrive, not the arithmetic: the same bits either way."""
    import triton

    from quantserve.server.fastcore import triton_gemv, triton_mm

    q8, q4 = layers(N, K, seed=7, device=DEVICE, dtype=DTYPE)
    x = (torch.randn(1, K, device=DEVICE) * 2 + 0.3).to(DTYPE)
    # BLOCK_K 256: one word a thread and row on 2 warps (int8: 4 columns a word) or 1 (int4: 8), so each
    # split takes several K steps
    kernels = ((triton_gemv.int8_gemv_kernel.fn, (x, q8.weight, q8.scales), {}, q8, 2),
               (triton_gemv.int4_gemv_kernel.fn, (x, q4.weight, q4.scales, q4.mins), {"GROUP": q4.group_size}, q4, 1))
    for split in (1, 2, 4):
        for fn, args, extra, q, warps in kernels:
            for form in ({}, {"DOT4": True}):
                config = triton.Config({"BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": split}, num_warps=warps, num_stages=1)
                y = {ahead: triton_mm.run_choice(fn, config, 1, 1, N, K, x, args,
                                                 {**extra, **form, "BIT_DEQUANT": True, "AHEAD": ahead})
                     for ahead in (True, False)}
                what = f"split {split} {form} {fn}"
                check(y[True], fused_reference(q, x, False, None, 0.0, False, None), what, bound(form), DTYPE)
                assert torch.equal(y[True], y[False]), what
