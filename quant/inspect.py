"""`quant inspect FILE_OR_DIR`: say what a file or folder is, from its own bytes.

A GGUF file is read with gguf's `GGUFReader` (metadata and tensor table; no weights loaded), a
safetensors file through its header, a folder through its manifest (a `quant convert` output)
or config.json (a Hugging Face checkpoint or a bitsandbytes save).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from quantserve.formats import GGUF_MAGIC
from quantserve.quant.manifest import check_weights
from quantserve.quant.source import check_safetensors, read_json
from quantserve.settings import UserError

# Metadata values too long to print whole: summarised by length.
_LONG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.scores")


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, OSError) as e:
        raise UserError(f"{path}: corrupt or truncated GGUF file ({e})") from e


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type a GGUF file holds."""
    return dict(Counter(t.tensor_type.name for t in _reader(path).tensors))


def _field_value(field):
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        if field.name in _LONG_ARRAYS:
            return f"[{len(field.data)} items]"
        return field.contents()
    return field.contents()


def describe_gguf(path: Path) -> dict:
    reader = _reader(path)
    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = _field_value(field)
        if name == "tokenizer.chat_template" and isinstance(value, str) and len(value) > 120:
            value = value[:117] + "..."
        metadata[name] = value
    tensors = [{"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape]}
               for t in reader.tensors]
    return {"kind": "GGUF", "path": str(path), "size_bytes": path.stat().st_size,
            "architecture": metadata.get("general.architecture"),
            "tensor_count": len(tensors),
            "tensor_types": dict(Counter(t["type"] for t in tensors)),
            "metadata": metadata, "tensors": tensors}


def describe_safetensors(path: Path) -> dict:
    header = check_safetensors(path)
    return {"kind": "safetensors", "path": str(path), "size_bytes": path.stat().st_size,
            "tensor_count": len(header),
            "dtypes": dict(Counter(v["dtype"] for v in header.values())),
            "tensors": [{"name": k, "dtype": v["dtype"], "shape": v["shape"]}
                        for k, v in header.items()]}


def describe_folder(path: Path) -> dict:
    from quantserve.formats import NotAModel, identify

    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        return {"kind": "LoRA adapter", "path": str(path),
                "adapter_config": read_json(path / "adapter_config.json")}
    try:
        found = identify(path)
    except NotAModel as e:
        raise UserError(f"{e} (inspect reads a GGUF file, a safetensors file, a checkpoint or a quant output "
                        "folder)") from None
    fmt = {"format": found.format.name, "served_by": found.format.engine}
    if found.manifest is not None:
        check_weights(path, found.manifest)  # a conversion whose weights are gone or cut short is no output
        out = {"kind": f"quant output ({found.manifest.get('format')})", "path": str(path), **fmt,
               "manifest": found.manifest}
        if found.container == "gguf":
            out["gguf"] = describe_gguf(found.path)
        return out
    if found.container == "gguf":
        return {**describe_gguf(found.path), **fmt}
    config = read_json(path / "config.json")
    qc = config.get("quantization_config")
    files = sorted(path.glob("*.safetensors"))
    tensors = sum(len(check_safetensors(f)) for f in files)
    kind = (f"bitsandbytes checkpoint ({qc.get('quant_method')})" if found.format.name.startswith("bnb-")
            else f"{found.format.name.upper()} checkpoint" if found.format.name in ("awq", "gptq")
            else f"Hugging Face checkpoint, quantized ({qc.get('quant_method')})" if qc else "Hugging Face checkpoint")
    return {"kind": kind, "path": str(path), **fmt, "architecture": (config.get("architectures") or ["?"])[0],
            "tensor_count": tensors, "weight_files": [f.name for f in files],
            "quantization_config": qc, "config": config}


def inspect(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_dir():
        return describe_folder(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == GGUF_MAGIC:
        return describe_gguf(path)
    if path.suffix == ".safetensors":
        return describe_safetensors(path)
    raise UserError(f"{path}: not a GGUF or safetensors file (starts with {magic!r})")


def format_report(info: dict, show_tensors: bool = False) -> str:
    """A human-readable summary; `--json` prints `info` itself."""
    lines = [f"{info['path']}: {info['kind']}"]
    gg = info.get("gguf") if "gguf" in info else (info if info["kind"] == "GGUF" else None)
    if "manifest" in info:
        m = info["manifest"]
        mem = m.get("serving_memory", {})
        lines.append(f"  source: {m['source']['path']} ({m['source']['architecture']})")
        lines.append(f"  size: {m['size_bytes'] / 2**20:.2f} MiB, tensors: {m.get('tensor_count')}")
        lines.append(f"  serving memory: {mem.get('total_mib')} MiB at context {mem.get('context')} "
                     "(weights + f16 KV cache)")
        if m.get("quality"):
            lines.append("  quality: " + json.dumps(m["quality"]))
    if gg:
        lines.append(f"  GGUF architecture {gg['architecture']}, {gg['tensor_count']} tensors, "
                     f"types {gg['tensor_types']}, {gg['size_bytes'] / 2**20:.2f} MiB")
        for k, v in gg["metadata"].items():
            lines.append(f"    {k} = {v!r}" if isinstance(v, str) and "\n" in v else f"    {k} = {v}")
        if show_tensors:
            lines += [f"    {t['name']:32} {t['type']:6} {t['shape']}" for t in gg["tensors"]]
    elif info["kind"] == "safetensors":
        lines.append(f"  {info['tensor_count']} tensors, dtypes {info['dtypes']}")
        if show_tensors:
            lines += [f"    {t['name']:48} {t['dtype']:5} {t['shape']}" for t in info["tensors"]]
    elif "config" in info:
        lines.append(f"  architecture {info['architecture']}, {info['tensor_count']} tensors in "
                     f"{', '.join(info['weight_files'])}")
        if info.get("quantization_config"):
            lines.append("  quantization: " + json.dumps(info["quantization_config"]))
    elif "adapter_config" in info:
        ac = info["adapter_config"]
        lines.append(f"  base {ac.get('base_model_name_or_path')}, r={ac.get('r')}, "
                     f"targets {ac.get('target_modules')}")
    return "\n".join(lines)
