"""manifest.json: what an output folder holds, where it came from, and what it costs to serve.

Written last inside the temporary folder, so a folder with a manifest is a finished conversion;
`quant eval` later adds its quality row under "quality".
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from quantserve.formats import MANIFEST
from quantserve.quant.source import check_safetensors
from quantserve.settings import UserError

KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type is F16; the T4 serves fp16 too


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("quantserve", "torch", "transformers", "safetensors", "bitsandbytes", "gguf",
                "llama_cpp_python", "peft"):
        try:
            out[pkg] = version(pkg.replace("_", "-"))
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def folder_size(folder: Path) -> int:
    """Bytes of everything in an output folder but the manifest itself."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def kv_cache_bytes(config: dict, context: int) -> int:
    """K and V for every layer and KV head at `context` tokens."""
    c = config.get("text_config") or config
    n_head = int(c["num_attention_heads"])
    n_kv = int(c.get("num_key_value_heads") or n_head)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // n_head)
    return 2 * int(c["num_hidden_layers"]) * n_kv * head_dim * context * KV_BYTES_PER_VALUE


def serving_memory(config: dict, weight_bytes: int, context: int) -> dict:
    kv = kv_cache_bytes(config, context)
    return {"context": context, "weights_bytes": weight_bytes, "kv_cache_bytes": kv,
            "kv_cache_dtype": "f16", "total_bytes": weight_bytes + kv,
            "total_mib": round((weight_bytes + kv) / 2**20, 2),
            "note": "weights + KV cache only; runtime buffers (activations, logits) come on top"}


def build_manifest(*, ckpt, fmt: str, out_dir: Path, weight_files: list[Path], summary: dict,
                   context: int, seconds: float) -> dict:
    weight_bytes = sum(f.stat().st_size for f in weight_files)
    return {
        "format": fmt,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {
            "path": str(ckpt.origin.resolve()),
            "architecture": ckpt.architecture,
            "lora_base": str(ckpt.adapter_base.resolve()) if ckpt.adapter_base else None,
            "files_sha256": ckpt.source_files,
        },
        "files": sorted(p.name for p in out_dir.iterdir() if p.is_file() and p.name != MANIFEST),
        "weight_files": [f.name for f in weight_files],
        "tensor_count": summary.get("tensors"),
        "size_bytes": folder_size(out_dir),
        "weights_bytes": weight_bytes,
        "serving_memory": serving_memory(ckpt.config, weight_bytes, context),
        "conversion": {k: v for k, v in summary.items() if k != "tensors"},
        "tool_versions": tool_versions(),
        "seconds": round(seconds, 2),
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    """Write atomically (temp file + rename): a reader never sees half a manifest."""
    tmp = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    tmp.replace(folder / MANIFEST)


def check_weights(folder: Path, manifest: dict | None) -> None:
    """The weight files of an output folder are there and whole (headers and lengths; nothing
    loaded): those its manifest lists, else every *.safetensors in it.  A weights file deleted or cut
    short after the conversion would otherwise pass for a finished output, or fail later in a
    library's words."""
    folder = Path(folder)
    listed = (manifest or {}).get("weight_files")
    names = ([str(n) for n in listed] if isinstance(listed, list)
             else sorted(p.name for p in folder.glob("*.safetensors")))
    for name in names:
        f = folder / name
        if f.resolve().parent != folder.resolve() or not f.is_file():
            raise UserError(f"{folder}: its {MANIFEST} names {name!r}, which is not a file in it")
        if f.suffix == ".safetensors":
            check_safetensors(f)


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise UserError(f"{folder}: no {MANIFEST} (not a `quant convert` output folder)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e
