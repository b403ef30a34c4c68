"""What `quant convert` reads: a checked Hugging Face checkpoint folder.

Every problem with the input is found here, before anything is written: a folder that is not a
checkpoint, a config that is not JSON, an architecture no converter handles, a safetensors file
whose header is garbage or whose tensor data is cut short.  A LoRA adapter folder is merged into
its base model first, so the converters only ever see a plain checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from quantserve.settings import UserError, require_checkpoint


@dataclass
class Checkpoint:
    path: Path                      # folder holding config.json, *.safetensors and the tokenizer
    origin: Path                    # what the user named (the adapter folder for a LoRA)
    config: dict
    architecture: str
    weight_files: list[Path]
    adapter_base: Path | None = None  # set when `origin` was a LoRA adapter merged into this base
    source_files: dict[str, str] = field(default_factory=dict)  # name → sha256 of what was read

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config") or self.config


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def check_safetensors(path: Path) -> dict:
    """Validate a safetensors file's header and length without loading it; return the header.

    Layout: 8-byte little-endian header length, JSON header, then tensor bytes whose extent the
    header's `data_offsets` give.  A file cut short by a failed copy fails the length check.
    """
    size = path.stat().st_size
    if size < 8:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes)")
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len <= 1 or 8 + header_len > size:
            raise UserError(f"{path}: corrupt or truncated safetensors file "
                            f"(header says {header_len} bytes, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: corrupt safetensors header ({e})") from e
    try:
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise UserError(f"{path}: corrupt safetensors header (bad tensor entry)") from e
    have = size - 8 - header_len
    if have != end:
        state = "truncated" if have < end else "has trailing bytes"
        raise UserError(f"{path}: safetensors file is {state}: its header describes {end} bytes "
                        f"of tensor data, the file holds {have}")
    return tensors


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_folder(folder: Path) -> dict[str, str]:
    """sha256 of every regular file directly in `folder` (checkpoints are flat)."""
    return {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.is_file()}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors weights; pickle-only checkpoints are refused (unpickling runs code)."""
    from quantserve.modeling import pickle_weights

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if pickle_weights(folder):
            raise UserError(f"{folder}: only safetensors checkpoints are converted (found pickle weights; "
                            "if you trust the source, re-save with save_pretrained(safe_serialization=True))")
        raise UserError(f"{folder}: no *.safetensors weight files")
    return files


def architecture_of(config: dict, folder: Path) -> str:
    archs = config.get("architectures") or []
    if not archs or not isinstance(archs, list):
        raise UserError(f"{folder}/config.json names no architecture (no 'architectures' list)")
    return str(archs[0])


# Files a tokenizer is built from (one of them is needed); tokenizer_config.json alone is not one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def checkpoint_tokenizer(folder: Path):
    """The folder's Hugging Face tokenizer, or one UserError naming the folder: transformers says
    "Couldn't instantiate the backend tokenizer ..." when the tokenizer files are simply missing."""
    from quantserve.modeling import load_tokenizer

    folder = Path(folder)
    try:
        return load_tokenizer(folder)
    except (OSError, ValueError, KeyError) as e:
        require_tokenizer_files(folder)
        raise UserError(f"{folder}: cannot load its tokenizer: {str(e).splitlines()[0]}") from e


def require_tokenizer_files(folder: Path) -> None:
    """One UserError where `folder` has none of the files a tokenizer is built from."""
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{folder}: no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                        "copy the model's tokenizer into the folder")


def open_checkpoint(src: Path, merge_dir: Path | None = None) -> Checkpoint:
    """Check `src` and describe it; a LoRA adapter is merged into its base under `merge_dir`."""
    src = require_checkpoint(Path(src))
    if (src / "adapter_config.json").is_file():
        if merge_dir is None:
            raise UserError(f"{src}: is a LoRA adapter; it must be merged before use")
        return _merge_adapter(src, merge_dir)
    config = read_json(src / "config.json")
    files = weight_files(src)
    for f in files:
        check_safetensors(f)
    ckpt = Checkpoint(src, src, config, architecture_of(config, src), files)
    ckpt.source_files = hash_folder(src)
    return ckpt


def merged_adapter(adapter: Path) -> Path:
    """A LoRA adapter folder merged into its base, for serving: made once under the cache folder
    (`merged/`), keyed by the adapter's files and the base's (path, sizes, times), then reused."""
    import os
    import shutil

    from quantserve.settings import cache_dir

    adapter = Path(adapter)
    base = _adapter_base(adapter)
    key = hashlib.sha256(json.dumps({
        "adapter": hash_folder(adapter), "base": str(base.resolve()),
        "base_files": sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in base.iterdir() if f.is_file()),
    }, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir() / "merged" / f"{adapter.resolve().name}-{key}"
    if (folder / "config.json").is_file():
        return folder
    work = folder.with_name(f"{folder.name}.part-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        _merge_adapter(adapter, work, base)
        work.rename(folder)  # whole or not at all: a merge cut short is never served
    except OSError:
        if not (folder / "config.json").is_file():  # not another server's merge finishing first
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _adapter_base(adapter: Path) -> Path:
    """The local base checkpoint folder an adapter names (relative names: beside the adapter first)."""
    adapter_cfg = read_json(adapter / "adapter_config.json")
    base_name = adapter_cfg.get("base_model_name_or_path")
    if not base_name:
        raise UserError(f"{adapter}/adapter_config.json has no base_model_name_or_path")
    base_path = Path(base_name).expanduser()
    if not base_path.is_absolute():
        base_path = (adapter / base_path) if (adapter / base_path).is_dir() else base_path
    if not base_path.is_dir():
        raise UserError(f"{adapter}: base model {base_name!r} of the adapter is not a local folder")
    return base_path


def _merge_adapter(adapter: Path, out: Path, base_path: Path | None = None) -> Checkpoint:
    """Merge a PEFT LoRA adapter into its base (`base_path`, else the one its config names) and
    save the result as a plain checkpoint."""
    base = open_checkpoint(base_path or _adapter_base(adapter))
    adapter_weights = sorted(adapter.glob("adapter_model.safetensors"))
    if not adapter_weights:
        raise UserError(f"{adapter}: LoRA adapter has no adapter_model.safetensors")
    check_safetensors(adapter_weights[0])

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # the base was checked to hold safetensors; use_safetensors=True keeps transformers from ever
    # falling back to a pickle next to them
    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32, use_safetensors=True)
    try:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"{adapter}: cannot apply the LoRA adapter to {base.path}: "
                        f"{str(e).splitlines()[0]}") from e
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # The adapter folder's tokenizer wins (a fine-tune may have added tokens), else the base's.
    tok_dir = adapter if (adapter / "tokenizer_config.json").is_file() else base.path
    checkpoint_tokenizer(tok_dir).save_pretrained(out)
    config = read_json(out / "config.json")
    merged = Checkpoint(out, adapter, config, architecture_of(config, out), weight_files(out),
                        adapter_base=base.path)
    merged.source_files = {**{f"adapter/{k}": v for k, v in hash_folder(adapter).items()},
                           **{f"base/{k}": v for k, v in base.source_files.items()}}
    return merged


def require_causal_lm(ckpt: Checkpoint) -> None:
    """bitsandbytes works through transformers: any architecture it knows as a causal LM."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if ckpt.architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() \
            or not hasattr(transformers, ckpt.architecture):
        raise UserError(f"{ckpt.origin}: unsupported architecture {ckpt.architecture} "
                        f"(not a causal language model transformers {transformers.__version__} knows)")
    try:
        AutoConfig.from_pretrained(str(ckpt.path))
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"{ckpt.origin}: config.json is not usable: {str(e).splitlines()[0]}") from e


def require_causal_lm_folder(path: Path) -> None:
    """`require_causal_lm` for a folder about to be served, trained or run, from its config.json
    alone (nothing loaded): a BERT would otherwise load with a page of MISSING weights and fail
    later on something else.  A LoRA adapter's base is checked where it loads; a config naming no
    architecture is left to transformers, which picks the class by model_type."""
    path = Path(path)
    if (path / "adapter_config.json").is_file() or not (path / "config.json").is_file():
        return
    config = read_json(path / "config.json")
    archs = config.get("architectures")
    if archs and isinstance(archs, list):
        require_causal_lm(Checkpoint(path, path, config, str(archs[0]), weight_files=[]))


def parameter_count(ckpt: Checkpoint) -> int:
    """Number of weights, from the safetensors headers (nothing loaded)."""
    import math

    return sum(math.prod(entry.get("shape") or [1])
               for f in ckpt.weight_files for entry in check_safetensors(f).values())
