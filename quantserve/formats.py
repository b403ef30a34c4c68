"""Weight formats: one record each — what it is, how a file or folder is recognised as it, what
writes it and which engine serves it.

`quant convert` (the writers), `quant formats` (the table), `quant eval` and `quant inspect` (what
was given), `serve` (which engine loads it) and `quantserve info` all read this one table, so a new
format served by an existing engine is one record here plus its writer.  Writers are named as
"module:function" and imported only by `quant convert` when it runs (as vLLM's model registry
names its classes): this module is part of the ground layer and imports nothing of ours above it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantserve.settings import UsageError

GGUF_MAGIC = b"GGUF"
GGUF_FILE = "model.gguf"  # the file name inside a `quant convert` GGUF output folder
MANIFEST = "manifest.json"  # what `quant convert` writes last into an output folder


@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: float | None      # bits per weight of the quantized matrices (scales included); None: varies
    engine: str             # the engine that serves it: "hf", "gguf" or "fast"
    container: str          # "hf" (a checkpoint folder) or "gguf" (one .gguf file)
    description: str
    writer: str | None = None   # "module:function(ckpt, out_dir, option, progress) -> summary"; None: read only
    option: str | None = None   # what the writer is told (a GGUF file type, a bitsandbytes format)
    # a checkpoint folder's `quantization_config` -> is it this format? (folder formats only)
    detects: Callable[[dict], bool] | None = None
    # disk a conversion needs per parameter, to refuse up front when it cannot fit (k-quants hold
    # the intermediate F16 file too; bnb keeps embeddings and norms in 16 bit)
    disk_bytes_per_param: float = 2.7


def _bnb4(kind: str) -> Callable[[dict], bool]:
    return lambda q: bool(q.get("load_in_4bit")) and q.get("bnb_4bit_quant_type", "nf4") == kind


def _method(name: str) -> Callable[[dict], bool]:
    return lambda q: str(q.get("quant_method", "")).lower() == name


_BNB = "quantserve.quant.bnb:write_bnb"
_GGUF = "quantserve.quant.gguf_export:write_gguf_folder"
_KQUANT = "quantserve.quant.gguf_export:write_kquant"

# bits per weight: llama.cpp's own figures for Llama-shaped models; bitsandbytes' block scales included
_RECORDS = [
    WeightFormat("bnb-int8", 8.0, "hf", "hf", "LLM.int8: int8 rows, fp16 outlier columns (threshold 6)",
                 _BNB, "bnb-int8", lambda q: bool(q.get("load_in_8bit")), disk_bytes_per_param=1.1),
    WeightFormat("bnb-nf4", 4.13, "hf", "hf", "NF4, double-quantized block scales (QLoRA's format)",
                 _BNB, "bnb-nf4", _bnb4("nf4"), disk_bytes_per_param=0.6),
    WeightFormat("bnb-fp4", 4.13, "hf", "hf", "FP4, double-quantized block scales", _BNB, "bnb-fp4", _bnb4("fp4"),
                 disk_bytes_per_param=0.6),
    WeightFormat("gguf-f32", 32.0, "gguf", "gguf", "float32, no quantization", _GGUF, "f32", disk_bytes_per_param=4.0),
    WeightFormat("gguf-f16", 16.0, "gguf", "gguf", "float16, no quantization", _GGUF, "f16", disk_bytes_per_param=2.0),
    WeightFormat("gguf-q8_0", 8.5, "gguf", "gguf", "8-bit, one scale per 32 weights", _GGUF, "q8_0",
                 disk_bytes_per_param=1.07),
    # k-quants: our F16 GGUF first, then llama.cpp's own quantizer
    WeightFormat("gguf-q2_k", 2.96, "gguf", "gguf", "2-bit k-quant: large quality loss", _KQUANT, "q2_k"),
    WeightFormat("gguf-q3_k_m", 3.91, "gguf", "gguf", "3-bit k-quant, some tensors 4/5-bit", _KQUANT, "q3_k_m"),
    WeightFormat("gguf-q4_0", 4.5, "gguf", "gguf", "4-bit, one scale per 32 weights", _KQUANT, "q4_0"),
    WeightFormat("gguf-q4_k_s", 4.58, "gguf", "gguf", "4-bit k-quant", _KQUANT, "q4_k_s"),
    WeightFormat("gguf-q4_k_m", 4.85, "gguf", "gguf", "4-bit k-quant, some tensors 6-bit: the usual 4-bit choice",
                 _KQUANT, "q4_k_m"),
    WeightFormat("gguf-q5_0", 5.5, "gguf", "gguf", "5-bit, one scale per 32 weights", _KQUANT, "q5_0"),
    WeightFormat("gguf-q5_k_s", 5.54, "gguf", "gguf", "5-bit k-quant", _KQUANT, "q5_k_s"),
    WeightFormat("gguf-q5_k_m", 5.69, "gguf", "gguf", "5-bit k-quant, some tensors 6-bit", _KQUANT, "q5_k_m"),
    WeightFormat("gguf-q6_k", 6.56, "gguf", "gguf", "6-bit k-quant", _KQUANT, "q6_k"),
    # read, not written: checkpoints users bring
    WeightFormat("awq", 4.16, "fast", "hf", "AWQ 4-bit (GEMM layout), groups with zero points; repacked at load",
                 detects=_method("awq")),
    WeightFormat("gptq", 4.16, "fast", "hf", "GPTQ 4-bit, groups (no act-order); repacked at load",
                 detects=_method("gptq")),
    WeightFormat("hf", None, "hf", "hf", "a Hugging Face checkpoint: fp32 / fp16 / bf16 safetensors, not quantized"),
    # any other `quantization_config`: transformers loads it if that method's library is installed
    WeightFormat("hf-quantized", None, "hf", "hf", "a checkpoint another transformers quantizer wrote",
                 detects=lambda q: True),
    WeightFormat("gguf", None, "gguf", "gguf", "a GGUF file of any type (llama.cpp's format)"),
]
FORMATS: dict[str, WeightFormat] = {f.name: f for f in _RECORDS}
CONVERT_FORMATS: tuple[str, ...] = tuple(f.name for f in _RECORDS if f.writer)  # what `quant convert` writes


def check_format(name: str) -> WeightFormat:
    """The record `quant convert --format NAME` writes, or a UsageError naming the choices."""
    name = name.strip().lower()
    if name not in CONVERT_FORMATS:
        raise UsageError(f"unknown format {name!r} (known: {', '.join(CONVERT_FORMATS)})")
    return FORMATS[name]


class NotAModel(ValueError):
    """`path` is no model any engine here loads; the message says what it is instead."""


@dataclass(frozen=True)
class Identified:
    format: WeightFormat
    path: Path                  # the file or folder an engine loads (a GGUF output folder's file)
    manifest: dict | None       # a `quant convert` output's manifest.json, if there is one

    @property
    def container(self) -> str:
        return self.format.container


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NotAModel(f"{path}: unreadable ({e})") from e
    if not isinstance(data, dict):
        raise NotAModel(f"{path}: a JSON object was expected, not {type(data).__name__}")
    return data


def folder_format(config: dict) -> WeightFormat:
    """The format of a checkpoint folder with this config.json: its `quantization_config` says."""
    q = config.get("quantization_config") or {}
    if not q:
        return FORMATS["hf"]
    if not isinstance(q, dict):
        raise NotAModel(f"its quantization_config is a {type(q).__name__}, not an object")
    return next(f for f in _RECORDS if f.detects is not None and f.detects(q))


def identify(path: Path) -> Identified:
    """What `path` is: a GGUF file, a folder holding one (a `quant convert` output included) or a
    checkpoint folder of one of the formats above.  Raises NotAModel saying what is wrong."""
    from quantserve.modeling import PICKLE_WEIGHTS

    path = Path(path)
    if not path.exists():
        raise NotAModel(f"{path}: no such file or folder")
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == GGUF_MAGIC:
            return Identified(FORMATS["gguf"], path, None)
        if path.suffix == ".gguf":
            raise NotAModel(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        if any(path.match(pattern) for pattern in PICKLE_WEIGHTS):
            raise NotAModel(f"{path}: a pickle weight file, not a model (a model is a .gguf file or a Hugging "
                            "Face checkpoint folder: safetensors, its pickle weights only when trusted)")
        raise NotAModel(f"{path}: not a model (a model is a .gguf file or a Hugging Face checkpoint folder)")
    manifest = _read_json(path / MANIFEST) if (path / MANIFEST).is_file() else None
    if manifest and manifest.get("gguf_file"):
        inner = path / str(manifest["gguf_file"])
        if inner.resolve().parent != path.resolve() or not inner.is_file():
            raise NotAModel(f"{path}: its {MANIFEST} names {manifest['gguf_file']!r}, which is not a file in it")
        fmt = manifest.get("format")
        return Identified(FORMATS.get(fmt, FORMATS["gguf"]) if isinstance(fmt, str) else FORMATS["gguf"], inner,
                          manifest)
    has_config = (path / "config.json").is_file()
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not has_config:
        if len(ggufs) > 1:
            raise NotAModel(f"{path}: holds {len(ggufs)} .gguf files; name the file itself")
        return Identified(FORMATS["gguf"], ggufs[0], manifest)
    if not has_config:
        raise NotAModel(f"{path}: not a Hugging Face checkpoint (no config.json) and no .gguf file")
    try:
        return Identified(folder_format(_read_json(path / "config.json")), path, manifest)
    except NotAModel as e:
        raise NotAModel(str(e) if str(e).startswith(str(path)) else f"{path}: {e}") from None
