"""`quantserve info MODEL`: what a model is, which engines and output formats take it, and why not
where not.

Each verdict comes from the check the engine or converter itself runs (the fast engine's config
reader, the GGUF converter's architecture table and hyperparameter checks, transformers' causal-LM
registry, the AWQ / GPTQ config check), so this report and the real command cannot disagree.
Nothing is loaded but configs and file headers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from quantserve.settings import UserError


@dataclass
class Verdict:
    what: str   # "engine fast", "formats gguf-*"
    ok: bool
    why: str


def _fast(path: Path, config: dict, pre: dict | None, bnb: str | None) -> Verdict:
    if bnb:
        return Verdict("engine fast", False, f"a bitsandbytes {bnb} checkpoint: the fast engine quantizes fp16 "
                       "weights itself (serve the checkpoint this came from with --weight-quant int8|int4)")
    if pre:
        return Verdict("engine fast", True, f"{pre['method'].upper()} 4-bit, group {pre['group_size']}: "
                       "its integers are repacked for the int4 kernels at load")
    from transformers import AutoConfig

    from quantserve.server.fastcore.model import ModelArgs

    try:
        ModelArgs.from_hf(AutoConfig.from_pretrained(str(path)))
    except (ValueError, KeyError) as e:
        return Verdict("engine fast", False, str(e))
    return Verdict("engine fast", True, f"{config.get('model_type')}: fp16, or int8 / int4 quantized at load "
                   "(CUDA graphs and Triton kernels on a GPU; eager on a CPU)")


def _hf(ckpt, pre: dict | None, bnb: str | None) -> Verdict:
    from quantserve.quant.source import require_causal_lm

    if pre:
        return Verdict("engine hf", False, f"transformers reads {pre['method'].upper()} weights only with "
                       "AutoAWQ / GPTQModel installed; the fast engine serves them")
    try:
        require_causal_lm(ckpt)
    except UserError as e:
        return Verdict("engine hf", False, str(e))
    return Verdict("engine hf", True, f"transformers {ckpt.architecture}" + (f", bitsandbytes {bnb}" if bnb else ""))


def _gguf_formats(ckpt, bnb: str | None) -> Verdict:
    from quantserve.quant.gguf_export import hyperparameters
    from quantserve.quant.gguf_architectures import gguf_architecture

    if bnb:
        return Verdict("formats gguf-*", False, "already quantized by bitsandbytes: convert the checkpoint it came from")
    try:
        arch = gguf_architecture(ckpt).name
        hyperparameters(ckpt)
        tokenizer = _gguf_tokenizer_kind(ckpt.path)
    except UserError as e:
        return Verdict("formats gguf-*", False, str(e))
    return Verdict("formats gguf-*", True, f"llama.cpp architecture {arch!r}, {tokenizer} tokenizer "
                   "(F16, Q8_0, k-quants; served by the gguf engine)")


def _gguf_tokenizer_kind(folder: Path) -> str:
    """The tokenizer kind the GGUF writer will write, or its UserError."""
    import json

    from quantserve.quant.gguf_vocab import is_sentencepiece_style, pre_tokenizer_name

    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{folder}: no tokenizer.json (GGUF carries the tokenizer; a fast tokenizer is required)")
    tokenizer_json = json.loads(tok_file.read_text(encoding="utf-8"))
    if is_sentencepiece_style(tokenizer_json):
        return "SentencePiece"
    return f"byte-level BPE ({pre_tokenizer_name(tokenizer_json, folder)})"


def _bnb_formats(ckpt, pre: dict | None, bnb: str | None) -> Verdict:
    from quantserve.quant.source import require_causal_lm

    if bnb:
        return Verdict("formats bnb-*", False, f"already a bitsandbytes {bnb} checkpoint")
    try:
        require_causal_lm(ckpt)
    except UserError as e:
        return Verdict("formats bnb-*", False, str(e))
    how = f" (from the {pre['method'].upper()} weights dequantized)" if pre else ""
    return Verdict("formats bnb-*", True, f"int8, nf4, fp4 through transformers{how}; served by the hf engine")


def checkpoint_support(path: Path) -> list[Verdict]:
    """Verdicts for a Hugging Face checkpoint folder."""
    from quantserve.quant.prequantized import quantization_config
    from quantserve.quant.source import open_checkpoint
    from quantserve.modeling import check_config_file
    from quantserve.server.hf_engine import quantization_of

    check_config_file(path)  # a zero head count would crash the verdicts below (ZeroDivisionError)
    ckpt = open_checkpoint(path)
    try:
        pre = quantization_config(path)
    except UserError as e:  # an AWQ / GPTQ variant we refuse: every path says so
        return [Verdict(what, False, str(e)) for what in ("engine fast", "engine hf", "formats gguf-*", "formats bnb-*")]
    bnb = None if pre else quantization_of(path)
    # AWQ / GPTQ weights become floats before any conversion (quant/prequantized.py)
    conv = ckpt if not pre else _dequantized_view(ckpt)
    return [_fast(path, ckpt.config, pre, bnb), _hf(ckpt, pre, bnb), _gguf_formats(conv, bnb),
            _bnb_formats(conv, pre, bnb)]


def _dequantized_view(ckpt):
    """The checkpoint as `quant convert` sees it after dequantizing: same config, no quantization."""
    from dataclasses import replace

    config = {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    return replace(ckpt, config=config)


def model_support(path: Path) -> dict:
    """What `path` is (quant inspect's summary), what `serve --engine auto` would pick, and verdicts."""
    from quantserve.quant.inspect import inspect

    path = Path(path)
    info = inspect(path)
    out = {"path": str(path), "kind": info["kind"], "architecture": info.get("architecture")}
    if info["kind"] == "GGUF" or "gguf" in info:
        gg = info if info["kind"] == "GGUF" else info["gguf"]
        out["architecture"] = gg["architecture"]
        out["verdicts"] = [
            Verdict("engine gguf", True, f"llama.cpp, {gg['architecture']}, types {gg['tensor_types']}"),
            Verdict("engine fast / hf", False, "they read safetensors checkpoints; a GGUF file is llama.cpp's"),
            Verdict("formats", False, "already converted: convert the checkpoint it came from")]
        out["auto_engine"] = ("gguf", "a GGUF file")
    elif info["kind"] == "LoRA adapter":
        out["verdicts"] = [Verdict("engine hf", True, "served on its base model (quantserve serve ADAPTER)"),
                           Verdict("formats", True, "quant convert merges it into its base first")]
        out["auto_engine"] = ("hf", "a LoRA adapter")
    elif "config" in info or info.get("manifest"):  # a checkpoint, or a bitsandbytes output of `quant convert`
        from quantserve.server.engines import auto_engine

        out["verdicts"] = checkpoint_support(path)
        out["auto_engine"] = auto_engine(path)
    else:
        raise UserError(f"{path}: {info['kind']}: not a model (a checkpoint folder, a .gguf file or an adapter)")
    out["verdicts"] = [asdict(v) for v in out["verdicts"]]
    return out


def format_support(report: dict) -> str:
    lines = [f"{report['path']}: {report['kind']}" + (f", {report['architecture']}" if report.get("architecture") else "")]
    engine, why = report["auto_engine"]
    lines.append(f"  serve --engine auto here: {engine} ({why})")
    for v in report["verdicts"]:
        lines.append(f"  {'yes' if v['ok'] else 'no ':3}  {v['what']:16} {v['why']}")
    return "\n".join(lines)
