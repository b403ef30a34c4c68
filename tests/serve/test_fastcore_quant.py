"""The fast core's quantized layers (fastcore/quant.py) and what they cost in quality, on the CPU.

The layers' conventions against torch's own int4 kernel, which groups the Triton kernels leave to
the torch path, fp16 safety of the torch int8 path; then quality on the default model's held-out
windows (bench/quality.py): int8 KV cache, int4 weights, x rounded to int8 as the batch-1 dp4a
kernels do, and the one-token-a-step scoring that measures the GPU's batch-1 path.
"""

from __future__ import annotations

import pytest
import torch

from quantserve.server.fastcore import FastCore
from quantserve.server.fastcore.quant import Int4Linear, quantize_int4


def test_int4_layout_is_the_one_torch_int4_kernels_expect():
    """Our scales/zeros convention ((q - 8) * scale + zero, [K/g, N, 2]) is what tinygemm reads:
    torch's CPU int4 kernel takes the same layout and must agree with our dequant path."""
    torch.manual_seed(0)
    w, x = torch.randn(64, 256), torch.randn(3, 256)
    q, scales, zeros = quantize_int4(w, 64)
    sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    y_torch = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz)
    y_ours = Int4Linear(w, None, torch.float32, 64, "torch")(x)
    assert torch.allclose(y_torch, y_ours, atol=1e-4)
    # and the quantization itself is within half a step of the weights
    deq = Int4Linear(w, None, torch.float32, 64, "torch").dequantize(torch.float32)
    step = scales.repeat_interleave(64, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()


def test_int4_groups_the_triton_kernels_cannot_walk_take_the_torch_path():
    """The Triton int4 kernels walk K in power-of-two blocks of >= 64 inside one group: a group of
    96 (a 64-wide block would straddle two) or 32 is served by the torch path, with its own sums."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 192), torch.randn(2, 192)
    for group in (96, 32):
        layer = Int4Linear(w, None, torch.float32, group, "triton")
        assert layer.kernel == "torch", group
        assert torch.allclose(layer(x), x @ layer.dequantize(torch.float32).t(), atol=1e-4)
    assert Int4Linear(w.repeat(1, 2)[:, :256], None, torch.float32, 64, "triton").kernel == "triton"


ALL = {"norm", "gate", "residual"}


@pytest.mark.parametrize("value, int8, int4", [(None, ALL, {"gate", "residual"}), ("0", set(), set()), ("1", ALL, ALL),
                                               ("gate, residual", {"gate", "residual"}, {"gate", "residual"}),
                                               ("norm", {"norm"}, {"norm"})])
def test_the_fused_batch1_forms_are_asked_for_by_name(monkeypatch, value, int8, int4):
    """$QUANTSERVE_FUSED_DECODE: unset all three for int8 and the gate and residual for int4, 0
    none, 1 all, or the forms named; a misspelt one is an error naming the choices, not a form
    quietly left out.  The norm form folds int8 layers' norms (never int4's).  On a CPU no layer
    takes any."""
    from quantserve.server.fastcore import fused, quant

    if value is None:
        monkeypatch.delenv("QUANTSERVE_FUSED_DECODE", raising=False)
    else:
        monkeypatch.setenv("QUANTSERVE_FUSED_DECODE", value)
    assert fused.fused_decode_forms("int8") == int8 and fused.fused_decode_forms("int4") == int4
    assert fused.fold_norms("int8") == ("norm" in int8) and not fused.fold_norms("int4")
    assert quant.Int8Linear(torch.randn(64, 128), None, torch.float32, "triton").fused_forms == frozenset()
    monkeypatch.setenv("QUANTSERVE_FUSED_DECODE", "gate,resdual")
    with pytest.raises(ValueError, match="comma list of norm, gate, residual"):
        fused.fused_decode_forms("int8")


def test_a_folded_norm_weight_is_the_same_layer_on_its_own_grid():
    """Int8Linear(w, fold=g) quantizes w * g (each input column scaled) in row chunks, without a
    full fp32 copy: the same integers and scales as quantizing the product; other weights refuse
    a fold (int4's groups would spread: +1.2 % perplexity)."""
    from quantserve.server.fastcore.quant import Int8Linear, make_linear, quantize_int8

    torch.manual_seed(3)
    w, g = torch.randn(96, 128), torch.rand(128) * 3 + 0.1
    layer = Int8Linear(w, None, torch.float32, "torch", fold=g)
    q, s = quantize_int8(w * g)
    assert torch.equal(layer.weight, q) and torch.allclose(layer.scales, s)
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), (x * g) @ w.t(), rtol=0.02, atol=0.05 * (x * g @ w.t()).abs().max().item())
    with pytest.raises(ValueError, match="int8 layers only"):
        make_linear(w, None, "int4", torch.float32, fold=g)


def test_int8_torch_fallback_does_not_overflow_fp16():
    """The plain-torch int8 path (CUDA without Triton, and the eager reference of the GPU tests)
    scales the weights before the matmul: fp16 sums of unscaled int8 weights reach inf."""
    from quantserve.server.fastcore.quant import int8_linear_torch, quantize_int8

    torch.manual_seed(0)
    w = torch.randn(64, 4096) * 0.05
    q, scales = quantize_int8(w)
    x = (torch.randn(4, 4096) * 40).half()  # large activations, as outlier features in real models
    y = int8_linear_torch(x, q, scales.half())
    assert torch.isfinite(y).all()
    ref = x.float() @ w.t()
    assert (y.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    # what the old formula (scale after the sum) gave on the same inputs
    assert not torch.isfinite(torch.nn.functional.linear(x, q.half()) * scales.half()).all()


def test_an_int8_kv_cache_costs_little_quality_and_half_the_memory():
    """The int8 cache against the full-precision one on the default model's held-out windows
    (bench/quality.py; 99.75 % agreement, +0.05 % perplexity when measured on this CPU)."""
    from quantserve.bench.quality import run

    row = run(None, n_windows=4, length=256)
    assert row["top1_agreement"] >= 0.99 and abs(row["ppl_change_pct"]) < 1.0, row
    from quantserve.server.fastcore.model import ModelArgs

    a = ModelArgs(vocab_size=8, dim=64, ffn_dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, norm_eps=1e-6)
    assert a.kv_bytes_per_token(2, int8=True) / a.kv_bytes_per_token(2) == pytest.approx(130 / 256)  # vs fp16


def test_int4_weights_keep_the_default_models_predictions():
    """int4 weights (group 128) against unquantized ones on the default model's held-out windows
    (bench/quality.py; 96.8 % top-1 agreement, +0.05 % perplexity over 8 windows on this CPU)."""
    from quantserve.bench.quality import run

    row = run(None, n_windows=4, length=256, weights="int4", kv="auto")
    assert row["top1_agreement"] >= 0.94 and abs(row["ppl_change_pct"]) < 1.0, row


def test_x_rounded_to_int8_as_the_dp4a_kernels_do_keeps_the_predictions():
    """The batch-1 dp4a kernels' rounding of x (triton_dp4a.py), emulated on the CPU: within half a
    step of max|x| / 127 per 4 or 8 columns, and on the default model's held-out windows within
    noise of x unrounded (bench/quality.py --round-x-to-int8; on this CPU, 8 windows: int8 weights
    99.61 % top-1 either way, int4 96.91 % against 96.81 %)."""
    from quantserve.bench.quality import _round, run

    x = torch.randn(3, 64) * torch.logspace(-2, 2, 64)
    for group in (4, 8):
        r = _round(x, group)
        step = x.reshape(3, -1, group).abs().amax(-1, keepdim=True) / 127
        assert not torch.equal(r, x)
        assert ((r - x).reshape(3, -1, group).abs() <= step / 2 * (1 + 1e-5)).all()
    row = run(None, n_windows=4, length=256, weights="int8", kv="auto", round_x=True)
    assert row["x_rounded_to_int8"] and row["top1_agreement"] >= 0.99 and abs(row["ppl_change_pct"]) < 1.0, row


def test_quality_scored_one_token_a_step_matches_one_prefill(default_model):
    """bench/quality.py --decode (the batch-1 path: on a GPU the fused kernels) scores the same
    positions as a window's one prefill: the same logits, token by token, on the CPU's one path."""
    import numpy as np

    from quantserve.bench.quality import score, score_decoding, windows
    from quantserve.modeling import load_tokenizer

    wins = windows(load_tokenizer(default_model), 2, 32)
    core = FastCore(default_model, max_slots=1, max_seq=64, device="cpu", compile=False)
    for a, b in zip(score(core, wins), score_decoding(core, wins)):
        assert a.shape == b.shape == (31, core.args.vocab_size)
        np.testing.assert_allclose(a, b, atol=2e-4)
