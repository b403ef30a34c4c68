"""4-bit checkpoints quantized by others: AWQ (GEMM layout) and GPTQ, read by their published layouts.

Both store each linear layer as packed 4-bit integers with per-group scales and zero points over
the input dimension (K), groups of `group_size`:

* AWQ (AutoAWQ, `version: "gemm"`): `qweight` int32 [K, N/8] and `qzeros` int32 [K/g, N/8], eight
  values per int32 along N in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column
  AWQ_ORDER[i]); `scales` fp16 [K/g, N].  w[n, k] = (q[k, n] - z[k/g, n]) * s[k/g, n].
* GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K/8, N], eight values per int32 along K, nibble j
  is row 8i + j; `qzeros` int32 [K/g, N/8] along N in plain order; `scales` fp16 [K/g, N];
  `g_idx` int32 [K], the group of each input row.  The original format ("gptq", v1) stores each
  zero point minus one: w = (q - (z + 1)) * s; "gptq_v2" stores it as is.  Act-order checkpoints
  (`desc_act`, a g_idx that is not k // g) are refused: their groups are not contiguous.

`linear_int4` gives a layer's (q [N, K] 0..15, scales [N, K/g], zero points [N, K/g]), exactly as
stored; `dequantize` the float weight; `write_dequantized` a plain fp16 checkpoint any tool reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantserve.quant.source import read_json
from quantserve.settings import UserError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble (low to high) in an AWQ int32


def _read(folder: Path) -> dict | str | None:
    """The checked AWQ / GPTQ settings, what is wrong with them (a str), or None (neither)."""
    cfg = read_json(Path(folder) / "config.json")  # a broken config.json: named, and what is wrong
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if method not in ("awq", "gptq"):
        return None
    where = f"{folder}: {method.upper()} checkpoint"
    if int(q.get("bits", q.get("w_bit", 0))) != 4:
        return f"{where} with {q.get('bits', q.get('w_bit'))}-bit weights: only 4-bit is supported"
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if group <= 0:
        return f"{where} without groups (group_size {group}): only grouped checkpoints are supported"
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        return f"{where} in the {q.get('version')!r} layout: only AWQ's GEMM layout is supported"
    if method == "gptq" and q.get("desc_act"):
        return f"{where} quantized with act-order (desc_act): its groups are not contiguous, which is not supported"
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    return {"method": method, "group_size": group, "v1_zeros": method == "gptq" and fmt != "gptq_v2",
            "modules_to_not_convert": q.get("modules_to_not_convert") or []}


def quantization_problem(folder: Path) -> str | None:
    """Why this AWQ / GPTQ checkpoint cannot be read (None: it can, or it is neither); the engine
    raises its own error with it, `quantization_config` the CLI's."""
    found = _read(folder)
    return found if isinstance(found, str) else None


def quantization_config(folder: Path) -> dict | None:
    """The checkpoint's AWQ / GPTQ `quantization_config`, checked; None for any other checkpoint."""
    found = _read(folder)
    if isinstance(found, str):
        raise UserError(found)
    return found


def _unpack(packed, along: int, order=tuple(range(8))):
    """int32 tensor -> the 4-bit values it holds, spread 8x along dimension `along` (0 or 1)."""
    import torch

    nibbles = [(packed >> (4 * i)) & 0xF for i in range(8)]
    slots = [None] * 8
    for i, col in enumerate(order):
        slots[col] = nibbles[i]
    stacked = torch.stack(slots, dim=along + 1)  # [..., 8] right after the packed dimension
    shape = list(packed.shape)
    shape[along] *= 8
    return stacked.reshape(shape).to(torch.uint8)


def linear_int4(get, prefix: str, q: dict):
    """(q uint8 [N, K], scales float [N, K/g], zeros uint8-valued float [N, K/g]) of the layer
    `prefix` (e.g. "model.layers.0.self_attn.q_proj") from the tensor getter `get`."""
    import torch

    g = q["group_size"]
    scales = get(prefix + ".scales").float()  # [K/g, N]
    zeros = _unpack(get(prefix + ".qzeros"), 1, AWQ_ORDER if q["method"] == "awq" else tuple(range(8)))
    if q["method"] == "awq":
        ints = _unpack(get(prefix + ".qweight"), 1, AWQ_ORDER)  # [K, N]
    else:
        ints = _unpack(get(prefix + ".qweight"), 0)  # [K, N]
        g_idx = get(prefix + ".g_idx") if _has(get, prefix + ".g_idx") else None
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(ints.shape[0]) // g):
            raise UserError(f"{prefix}: g_idx is not in group order (act-order): not supported")
        if q["v1_zeros"]:
            zeros = zeros.to(torch.int16) + 1
    K, N = ints.shape
    if scales.shape != (K // g, N) or zeros.shape[0] != K // g:
        raise UserError(f"{prefix}: tensor shapes do not match {q['method'].upper()} with group size {g}")
    return ints.t().contiguous(), scales.t().contiguous(), zeros[:, :N].t().float().contiguous()


def _has(get, name: str) -> bool:
    try:
        get(name)
        return True
    except KeyError:
        return False


def dequantize(get, prefix: str, q: dict, dtype=None):
    """The layer's float weight [N, K]: (q - zero) * scale per group."""
    ints, scales, zeros = linear_int4(get, prefix, q)
    g = q["group_size"]
    w = (ints.float() - zeros.repeat_interleave(g, dim=1)) * scales.repeat_interleave(g, dim=1)
    return w if dtype is None else w.to(dtype)


def quantized_layers(names) -> list[str]:
    """The layer prefixes that are stored quantized (they have a qweight)."""
    return sorted(n[: -len(".qweight")] for n in names if n.endswith(".qweight"))


def tensor_getter(folder: Path):
    """(get(name) -> tensor, names) over every safetensors file of the folder."""
    from safetensors import safe_open

    index = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                index[name] = f

    def get(name: str):
        if name not in index:
            raise KeyError(name)
        with safe_open(str(index[name]), framework="pt") as st:
            return st.get_tensor(name)

    return get, list(index)


def write_dequantized(src: Path, dst: Path) -> Path:
    """A plain fp16 copy of the AWQ/GPTQ checkpoint `src` in `dst` (config without the
    quantization, tokenizer files as they are): every other tool reads it as an ordinary model."""
    import shutil

    import torch
    from safetensors.torch import save_file

    q = quantization_config(src)
    if q is None:
        raise UserError(f"{src}: not an AWQ or GPTQ checkpoint")
    get, names = tensor_getter(src)
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    layers = quantized_layers(names)
    for prefix in layers:
        out[prefix + ".weight"] = dequantize(get, prefix, q, torch.float16)
    packed = {p + s for p in layers for s in (".qweight", ".qzeros", ".scales", ".g_idx")}
    for name in names:
        if name not in packed:
            out[name] = get(name).to(torch.float16) if get(name).is_floating_point() else get(name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = read_json(src / "config.json")
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    return dst
