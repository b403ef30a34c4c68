"""AWQ and GPTQ checkpoints written by the formats' published layouts (bit by bit, not with the
reader's code): AutoAWQ's GEMM packing (qweight [K, N/8], nibble i of an int32 is column
AWQ_ORDER[i]) and GPTQ's (qweight [K/8, N] along K, qzeros along N, zero points stored minus one
in the original format).  No reference quantizer installs here without a CUDA torch (GPTQModel,
AutoAWQ), so these follow the formats' specifications."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 64


def rtn(w: torch.Tensor, sym: bool):
    """Round-to-nearest 4-bit per group of GROUP inputs: (q [N, K], zeros [N, K/g], scales [N, K/g])."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    if sym:
        s = g.abs().amax(-1).clamp(min=1e-8) / 7.5
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo).clamp(min=1e-8) / 15
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(g / s[..., None] + z[..., None]).clamp(0, 15)
    return q.reshape(N, K).to(torch.int64), z.to(torch.int64), s.half()


def pack(values: np.ndarray, axis: int, order) -> np.ndarray:
    """Eight 4-bit values per int32 along `axis`: nibble i of word j is element 8j + order[i]."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((v.shape[0] // 8, *v.shape[1:]), dtype=np.uint32)
    for j in range(words.shape[0]):
        for i, col in enumerate(order):
            words[j] |= v[8 * j + col] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32)


def write_checkpoint(default_model, out, method: str, sym: bool = False, v1: bool = True):
    """The default model with every decoder linear stored as `method`; returns {prefix: w_hat}."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(default_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out.mkdir()
    tensors, dequantized = {}, {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS):
            tensors[name] = t
            continue
        q, z, s = rtn(t, sym)
        dequantized[prefix] = (q - z.repeat_interleave(GROUP, 1)).float() * s.float().repeat_interleave(GROUP, 1)
        qT, zT, sT = q.t().numpy(), z.t().numpy(), s.t().contiguous()  # [K, N], [K/g, N]
        if method == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors[prefix + ".qweight"] = torch.from_numpy(pack(qT, 1, order))
            tensors[prefix + ".qzeros"] = torch.from_numpy(pack(zT, 1, order))
        else:
            tensors[prefix + ".qweight"] = torch.from_numpy(pack(qT, 0, range(8)))
            tensors[prefix + ".qzeros"] = torch.from_numpy(pack(zT - 1 if v1 else zT, 1, range(8)))
            tensors[prefix + ".g_idx"] = torch.arange(qT.shape[0], dtype=torch.int32) // GROUP
        tensors[prefix + ".scales"] = sT
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((default_model / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym, "desc_act": False,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in default_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return dequantized
