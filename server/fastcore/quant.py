"""Weight-only int8 and int4 linear layers, quantized at load from the fp16 weights.

Decode at small batch reads every weight once per step, so bytes are time.  Kernels, by name:
- "triton" (CUDA, the default there): `triton_mm.py`'s kernels read the int8 / packed int4 weights
  once and dequantize in registers, for any batch up to 64, on any GPU Triton runs on (a T4 too);
  at batch 1 `triton_gemv.py`'s matrix-vector kernels compete with them per layer shape (they were the
  faster on every layer timed), and prompts try 128-row tiles and dequantize-then-cuBLAS.
- "torch": plain torch ops.  int8 is gpt-fast's `linear(x, w.to(x.dtype)) * scale`, which only
  reads 1 byte/param if inductor turns the matmul into a fused reduction (batch 1 under
  coordinate-descent tuning; measured 0.86x fp16 on an H200, so it did not); int4 unpacks the
  nibbles and scales them (the same fusion hope).  On the CPU int8 uses torch's
  `_weight_int8pack_mm`, a real kernel there.
- "gemlite" (CUDA): GemLite's Triton kernels (matrix-vector at batch 1, split-K and tiled above),
  on the same integers and scales: int8 shares our [N, K] buffer (GemLite reads its transpose),
  int4 is repacked into GemLite's int32 words of 8 nibbles along K.  bench/kernels.py times it
  against "triton" per layer shape (bench/RESULTS.md says which won where).
- "tinygemm" (int4 only): `torch._weight_int4pack_mm`, tensor-core int4; CUDA sm_80+ with bf16
  activations only, so never on a T4 or under the T4 profile.
(torch's CUDA `_weight_int8pack_mm` is a naive one-thread-per-output kernel, and bitsandbytes
LLM.int8 decomposes outliers at run time: both slow at decode.)

Formats: int8 per-output-channel symmetric scales; int4 asymmetric per group of `group_size` input
columns (gpt-fast / torchao layout: q in 0..15, w = (q - 8) * scale + zero).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quantserve.server.fastcore.fused import fused_decode_forms, norm_args


# Rows quantized at a time: an fp32 copy of a whole 8B-model lm_head is 2 GiB, which does not fit
# next to the model under a 15 GiB (T4) budget.
ROW_CHUNK = 2048


def quantize_int8(w: torch.Tensor, columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N]) with symmetric per-row absmax scaling.  columns
    ([K] or None): a factor per input column multiplied in first (fused.fold_norms: an RMSNorm's weight)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], ROW_CHUNK):
        wf = w[i : i + ROW_CHUNK].float()
        if columns is not None:
            wf = wf * columns.float()
        s = wf.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q[i : i + ROW_CHUNK] = torch.round(wf / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[i : i + ROW_CHUNK] = s
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q uint8 values 0..15 [N, K], scales [N, K/g], zeros [N, K/g]).

    Dequantization is (q - 8) * scale + zero, the convention of torch's tinygemm kernel."""
    N, K = w.shape
    q = torch.empty((N, K), dtype=torch.uint8, device=w.device)
    scales = torch.empty((N, K // group_size), dtype=torch.float32, device=w.device)
    zeros = torch.empty_like(scales)
    for i in range(0, N, ROW_CHUNK):
        wg = w[i : i + ROW_CHUNK].float().reshape(-1, K // group_size, group_size)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        s = (hi - lo).clamp(min=1e-6) / 15
        scales[i : i + ROW_CHUNK], zeros[i : i + ROW_CHUNK] = s, lo + s * 8
        q[i : i + ROW_CHUNK] = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8).reshape(-1, K)
    return q, scales, zeros


@dataclass
class PackedInt4:
    """A linear layer quantized to 4 bits elsewhere (AWQ, GPTQ: quant/prequantized.py), kept as it
    is: q [N, K] in 0..15, scales and zero points [N, K/g]; w = (q - zero) * scale."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def to(self, device=None, **_) -> "PackedInt4":
        return PackedInt4(self.q.to(device), self.scales.to(device), self.zeros.to(device), self.group_size)

    @staticmethod
    def cat(parts: list["PackedInt4"]) -> "PackedInt4":
        """Layers stacked along their outputs (q, k and v into one matrix, as for float weights)."""
        if len({p.group_size for p in parts}) != 1:
            raise ValueError("layers with different group sizes cannot be fused")
        return PackedInt4(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]), parts[0].group_size)

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        return (self.q.float() - self.zeros.float().repeat_interleave(g, 1)) * self.scales.float().repeat_interleave(g, 1)


def cat_rows(parts):
    """torch.cat along the output rows, for float weights and PackedInt4 layers alike."""
    return PackedInt4.cat(parts) if isinstance(parts[0], PackedInt4) else torch.cat(parts)


@functools.cache
def triton_ops():
    """The Triton kernels module, or None where it cannot run (no CUDA GPU or no Triton)."""
    if not torch.cuda.is_available():
        return None
    try:
        from quantserve.server.fastcore import triton_mm
    except ImportError:
        return None
    return triton_mm


@functools.cache
def fused_ops():
    """The batch-1 fused kernels module (triton_fused.py), or None where the Triton kernels cannot run."""
    if triton_ops() is None:
        return None
    from quantserve.server.fastcore import triton_fused
    return triton_fused


@functools.cache
def gemlite_available() -> bool:
    """GemLite imports (it reads the GPU's name at import, so only where CUDA runs)."""
    if not torch.cuda.is_available():
        return False
    try:
        import gemlite
    except ImportError:
        return False
    # GemLite ships tuned configs per GPU, found by name; an H200 is an H100's chip (sm_90, 132
    # multiprocessors) with more memory, so it takes the H100's table instead of tuning every shape
    name = torch.cuda.get_device_name().lower()
    configs = Path(gemlite.__file__).parent / "configs"
    if not any(p.stem in name for p in configs.glob("*.json")) and "h200" in name and (configs / "h100.json").exists():
        gemlite.GemLiteLinear.load_config(str(configs / "h100.json"))
    return True


def _gemlite_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """GemLite's weight-only int8 layer over our int8 [N, K] and per-row scales (no copy of q)."""
    from gemlite.helper import A16W8_INT8

    return A16W8_INT8(device=q.device, dtype=dtype).from_weights(weight=q, scales=scales.to(dtype)[:, None])


def _gemlite_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """GemLite's 4-bit layer for w = q * scale + min: its fused form is q * scale + zero', with
    zero' = -z * scale for its HQQ zero point z, so z = -min / scale gives back our min."""
    from gemlite.helper import A16W4_HQQ_INT

    zeros = (-mins.float() / scales.float()).to(dtype)
    return A16W4_HQQ_INT(device=q.device, dtype=dtype).from_weights(W_q=q.to(torch.uint8), scales=scales.to(dtype),
                                                                     zeros=zeros)


# GemLite stays chosen by name (quant_kernel="gemlite", bench decode --kernels gemlite): at batch 1 our
# matrix-vector kernels (triton_gemv.py) now match or beat its int4 and int8 layers on the 8B and 1B
# shapes (bench/RESULTS.md, 2026-12-03, "Batch-1 matrix-vector kernels"), its int4 layers stay faster
# than our tiled ones at batch 8-32 but slower than fp16 there, and its compiled, CUDA-graphed decode
# test has not finished in bounded time on a GPU (it autotunes every M the step is recorded at).
GEMLITE_BY_DEFAULT = False


def default_kernel(device: torch.device, weights: str = "int8") -> str:
    """On a GPU ours (Triton), or GemLite for int4 once GEMLITE_BY_DEFAULT says so; plain torch
    ops on a CPU or without Triton."""
    if device.type != "cuda" or triton_ops() is None:
        return "torch"
    return "gemlite" if GEMLITE_BY_DEFAULT and weights == "int4" and gemlite_available() else "triton"


def _fused_forms(kernel: str, bias, q: torch.Tensor, weights: str, K: int) -> frozenset:
    """What a layer's `fused` may take into its batch-1 kernel (fused.py asks, while tracing: so a
    plain attribute, decided here): the forms asked for, where the layer runs our Triton kernel on a
    GPU, has no bias and a matrix-vector config covers K; none otherwise."""
    forms = fused_decode_forms(weights)
    if forms and kernel == "triton" and bias is None and q.is_cuda and fused_ops() is not None \
            and fused_ops().fits(weights, K):
        return forms
    return frozenset()


def int8_linear_torch(x, weight, scales):
    """x @ (weight * scales).T in plain torch ops (inductor fuses the dequantization into the
    matmul at batch 1).  The scales go on the weight, not on the output: unscaled int8 weights
    (up to 127) summed over K in fp16 overflow to inf."""
    return F.linear(x, weight.to(x.dtype) * scales[:, None])


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, kernel: str = "torch",
                 fold: torch.Tensor | None = None):
        """fold: the weight of the RMSNorm before this layer, multiplied into its columns (fused.fold_norms)."""
        super().__init__()
        if kernel not in ("triton", "gemlite", "torch"):
            raise ValueError(f"unknown int8 kernel {kernel!r} (triton, gemlite or torch)")
        # both Triton kernels walk K in whole blocks of 64
        self.kernel = kernel if weight.shape[1] % 64 == 0 else "torch"
        if self.kernel == "gemlite" and not weight.is_cuda:
            raise ValueError("the gemlite kernel needs the weights on a CUDA GPU")
        q, scales = quantize_int8(weight, fold)
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        # not a submodule: its buffers are views of ours, and state_dict() should stay ours
        self._gemlite = (_gemlite_int8(q, self.scales, dtype),) if self.kernel == "gemlite" else None
        self.fused_forms = _fused_forms(self.kernel, bias, q, "int8", q.shape[1])

    def forward(self, x):
        if self.kernel == "gemlite" and x.is_cuda:
            y = self._gemlite[0](x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        elif self.kernel == "triton" and x.is_cuda:
            y = triton_ops().int8_weight_mm(x.reshape(-1, x.shape[-1]), self.weight,
                                            self.scales).view(*x.shape[:-1], -1)
        elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight,
                                          self.scales.to(x.dtype)).view(*x.shape[:-1], -1)
        else:
            y = int8_linear_torch(x, self.weight, self.scales)
        return y if self.bias is None else y + self.bias

    def fused(self, x, norm=None, residual=None, gated: bool = False):
        """One token through this layer in one kernel, with the RMSNorm `norm` before it (a
        model.RMSNorm), silu(gate) * up of its halves and the residual add after it, as asked
        (triton_fused.py; only the `fused_forms`)."""
        return torch.ops.quantserve.int8_gemv_fused(x, self.weight, self.scales, *norm_args(norm), residual, gated)

    def weight_bytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * self.scales.element_size()


def int4_tinygemm_supported(device: torch.device, profile: str = "native") -> bool:
    """torch's int4 kernel: CUDA sm_80+ only, and never under the T4 profile (a T4 is sm_75)."""
    if device.type != "cuda" or profile == "t4":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 group_size: int = 128, kernel: str = "torch"):
        super().__init__()
        if isinstance(weight, PackedInt4):  # repacked as stored: the checkpoint's own integers
            group_size = weight.group_size
            q, scales = weight.q.to(torch.uint8), weight.scales.float()
            mins = -weight.zeros.float() * scales  # (q - z) * s = q * s + mins
        N, K = weight.q.shape if isinstance(weight, PackedInt4) else weight.shape
        if K % group_size:
            raise ValueError(f"int4 needs in_features ({K}) divisible by group_size ({group_size})")
        if kernel in ("triton", "gemlite") and (K % 64 or group_size < 64 or group_size & (group_size - 1)):
            kernel = "torch"  # both Triton kernels walk K in power-of-two blocks of >= 64 inside one group
        if kernel == "gemlite" and not (weight.q if isinstance(weight, PackedInt4) else weight).is_cuda:
            raise ValueError("the gemlite kernel needs the weights on a CUDA GPU")
        self.kernel, self.group_size, self.out_features = kernel, group_size, N
        if not isinstance(weight, PackedInt4):
            q, scales, zeros = quantize_int4(weight, group_size)
            mins = zeros - 8 * scales  # the group minimum: dequant is one multiply-add
        zeros = mins + 8 * scales  # tinygemm's convention: (q - 8) * scale + zero
        if kernel == "tinygemm":
            if N % 8 or K % (8 * 16):
                raise ValueError(f"tinygemm int4 needs out % 8 == 0 and in % 128 == 0 (got {N}x{K})")
            # torch >= 2.5 packs from uint8 [N, K/2] (even column in the high nibble), as torchao
            packed = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack(packed, 8))
            sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
            self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        elif kernel == "gemlite":
            # GemLite's own int32 packing only (ours would double the weights' memory);
            # `dequantize` unpacks from it
            self.gemlite = _gemlite_int4(q, scales, mins, dtype)
        elif kernel in ("triton", "torch"):
            self.register_buffer("weight", (q[:, ::2] << 4 | q[:, 1::2]).contiguous())  # [N, K/2]
            self.register_buffer("scales", scales.to(dtype))
            self.register_buffer("mins", mins.to(dtype))
        else:
            raise ValueError(f"unknown int4 kernel {kernel!r} (triton, gemlite, tinygemm or torch)")
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        self.fused_forms = _fused_forms(kernel, bias, q, "int4", K)

    def dequantize(self, dtype) -> torch.Tensor:
        N = self.out_features
        if self.kernel == "gemlite":  # its layer times the identity is its weight, transposed
            eye = torch.eye(self.gemlite.in_features, device=self.gemlite.W_q.device, dtype=dtype)
            return self.gemlite(eye).t()
        w = torch.stack([self.weight >> 4, self.weight & 0xF], dim=-1).view(N, -1, self.group_size)
        return (w.to(dtype) * self.scales.to(dtype)[..., None] + self.mins.to(dtype)[..., None]).view(N, -1)

    def forward(self, x):
        if self.kernel == "tinygemm":
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group_size, self.scales_and_zeros)
            y = y.to(x.dtype).view(*x.shape[:-1], -1)
        elif self.kernel == "gemlite" and x.is_cuda:
            y = self.gemlite(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        elif self.kernel == "triton" and x.is_cuda:
            y = triton_ops().int4_weight_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales, self.mins,
                                            self.group_size).view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias

    def fused(self, x, norm=None, residual=None, gated: bool = False):
        """As Int8Linear.fused."""
        return torch.ops.quantserve.int4_gemv_fused(x, self.weight, self.scales, self.mins, self.group_size,
                                                    *norm_args(norm), residual, gated)

    def weight_bytes(self) -> int:
        if self.kernel == "gemlite":
            return sum(t.numel() * t.element_size() for t in (self.gemlite.W_q, self.gemlite.scales, self.gemlite.zeros))
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "bias")


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, mode: str, dtype: torch.dtype,
                kernel: str = "torch", group_size: int = 128, fold: torch.Tensor | None = None) -> nn.Module:
    """An nn.Module computing x @ weight.T (+ bias) with weights stored as `mode`.  A PackedInt4
    weight stays as packed under int4, and is dequantized for any other mode.  fold: a factor per
    input column multiplied in (int8 only; fused.fold_norms)."""
    if isinstance(weight, PackedInt4) and mode != "int4":
        weight = weight.dequantize().to(dtype)
    if fold is not None and mode != "int8":
        raise ValueError(f"norm weights are folded into int8 layers only, not {mode}")
    if mode == "int8":
        return Int8Linear(weight, bias, dtype, "torch" if kernel == "tinygemm" else kernel, fold)
    if mode == "int4":
        return Int4Linear(weight, bias, dtype, group_size, kernel)
    if mode != "none":
        raise ValueError(f"unknown weight_quant {mode!r} (none, int8, int4)")
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


def triton_layers(model: nn.Module) -> list[tuple[str, tuple, int | None]]:
    """Every layer that runs our Triton weight kernels, as kernel_choices.compile_chosen takes them:
    (weights, its tensors as the op passes them after x, its group size or None)."""
    out = []
    for m in model.modules():
        if isinstance(m, Int8Linear) and m.kernel == "triton":
            out.append(("int8", (m.weight, m.scales), None))
        elif isinstance(m, Int4Linear) and m.kernel == "triton":
            out.append(("int4", (m.weight, m.scales, m.mins), m.group_size))
    return out


def linear_weight_bytes(m: nn.Module) -> int:
    if hasattr(m, "weight_bytes"):
        return m.weight_bytes()
    return sum(p.numel() * p.element_size() for p in m.parameters())
