"""Where FastCore's weights come from, and the Transformer built from them.

A weight source (`Weights`) is a getter of tensors by their Hugging Face names, a test of which
names exist, the model's HF config and its rotary frequencies.  There are four:

    a checkpoint folder, read tensor by tensor from its safetensors files   _checkpoint_tensors
    a transformers model (or a folder whose names are not the layout's)      _hf_tensors
    an AWQ / GPTQ checkpoint, read tensor by tensor                          _prequantized_tensors
    random weights of a config's shapes (benchmarks: no checkpoint)          _random_tensors

`build_transformer` then moves the weights to the device one at a time, stacked into model.py's
fused layers (and quantized) as the architecture's table says (architectures.py), so that no
more than one layer's weights exist twice at any moment.  A checkpoint folder's tensors are read
a few ahead of the build on worker threads (read_ahead.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import torch

from quantserve.server.fastcore.architectures import ARCHITECTURES
from quantserve.server.fastcore.fused import fold_norms
from quantserve.server.fastcore.model import ModelArgs, Transformer
from quantserve.server.fastcore.quant import PackedInt4, cat_rows, make_linear
from quantserve.server.fastcore.read_ahead import ReadAhead


class Weights(NamedTuple):
    get: Callable[[str], object]  # HF tensor name -> tensor (or PackedInt4: an AWQ / GPTQ layer kept 4-bit)
    has: Callable[[str], bool]
    config: object  # the HF config
    rope: dict  # {"full": (inv_freq, scale)}, and "sliding" (model.Transformer.setup_caches)
    prequantized: dict | None = None  # an AWQ / GPTQ checkpoint's quantization (quant/prequantized.py)
    read_ahead: ReadAhead | None = None  # a checkpoint folder's: reads `get`'s next tensors on threads


def open_weights(model, device: torch.device, dtype: torch.dtype, weight_quant: str,
                 random_config=None, seed: int = 0) -> Weights:
    """The weight source for FastCore's `model` argument: a checkpoint folder, a loaded HF model,
    or None with `random_config`."""
    if random_config is not None:
        return _random_tensors(random_config, device, dtype, seed)
    if isinstance(model, (str, Path)) and _prequantized(Path(model)) is not None:
        return _prequantized_tensors(Path(model), weight_quant == "int4")
    if isinstance(model, (str, Path)):
        return _checkpoint_tensors(Path(model), dtype, device) or _hf_tensors(_load_hf(model, dtype))
    return _hf_tensors(model)


def build_transformer(src: Weights, a: ModelArgs, device: torch.device, dtype: torch.dtype, mode: str,
                      kernel: str, group_size: int) -> Transformer:
    """model.py's Transformer with the source's weights, on `device`, linear layers in `mode`
    ("none", "int8", "int4") through `kernel` (quant.make_linear)."""
    arch = ARCHITECTURES[src.config.model_type]
    if src.read_ahead is not None:
        src.read_ahead.start(_names_in_order(arch, src, a))
    try:
        return _build(src, a, arch, device, dtype, mode, kernel, group_size)
    finally:
        if src.read_ahead is not None:
            src.read_ahead.close()


def _build(src: Weights, a: ModelArgs, arch, device, dtype, mode: str, kernel: str, group_size: int) -> Transformer:
    def w(name):
        return src.get(name).to(device=device)

    def param(name):
        return torch.nn.Parameter(w(name).to(dtype), requires_grad=False)

    with torch.device("meta"):
        m = Transformer(a)
    m.tok_embeddings.weight = param("model.embed_tokens.weight")
    m.norm.weight = param("model.norm.weight")
    # an AWQ / GPTQ checkpoint served in int4 keeps its own 4-bit layers and the float ones
    # (lm_head, usually) as its authors left them; any other mode quantizes everything alike
    packed = mode == "int4" and src.prequantized is not None
    lin = lambda wt, b, fold=None: make_linear(wt, b, "int4" if isinstance(wt, PackedInt4) else  # noqa: E731
                                               "none" if packed else mode, dtype, kernel, group_size, fold)
    fold = a.norm_offset == 0 and fold_norms(mode)  # int8 only (fused.fold_norms); not Gemma's (1 + w) norms
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        for ours, theirs in arch.norms.items():
            layer.get_submodule(ours).weight = param(p + theirs + ".weight")
        for ours, weights, biases in _linears(arch, src, a, p):
            parts = [w(name) for name in weights]
            weight = parts[0] if len(parts) == 1 else cat_rows(parts)
            bias = torch.cat([w(name) for name in biases]) if biases else None
            parent, _, attr = ours.rpartition(".")
            norm = layer.get_submodule(FOLDED[ours]) if fold and ours in FOLDED else None
            setattr(layer.get_submodule(parent), attr, lin(weight, bias, None if norm is None else norm.weight))
            if norm is not None:  # its weight is in the layer now (a new tensor: the source's may be shared)
                norm.weight = torch.nn.Parameter(torch.ones_like(norm.weight), requires_grad=False)
                norm.folded = True
            del parts, weight
    m.output = lin(w("lm_head.weight"), None)
    missing = [name for name, t in m.named_parameters() if t.is_meta]
    if missing:  # an architectures.py entry that names too few tensors for its ModelArgs
        raise ValueError(f"{src.config.model_type}: no checkpoint tensor for {', '.join(missing[:4])}")
    return m.eval()


# the linear layers whose input is the norm before them alone (model.Block): where fused.fold_norms
# says, that norm's weight goes into the layer's columns (the final norm stays: embeddings use it)
FOLDED = {"attention.wqkv": "attention_norm", "feed_forward.w13": "ffn_norm"}


def _linears(arch, src: Weights, a: ModelArgs, p: str) -> list[tuple[str, list[str], list[str]]]:
    """One layer's linear layers (prefix `p`): (our name, its weights' HF names, its biases')."""
    out = []
    for ours, theirs in arch.linears.items():
        biased = ours == "attention.wqkv" and a.qkv_bias and src.has(p + theirs[0] + ".bias")
        out.append((ours, [p + name + ".weight" for name in theirs],
                    [p + name + ".bias" for name in theirs] if biased else []))
    return out


def _names_in_order(arch, src: Weights, a: ModelArgs) -> list[str]:
    """The tensors _build asks the source for, in its order."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        names += [p + theirs + ".weight" for theirs in arch.norms.values()]
        for _, weights, biases in _linears(arch, src, a, p):
            names += weights + biases
    return names + ["lm_head.weight"]


def _rope_of(rot) -> dict:
    """{"full": (inv_freq, scale)} from a transformers rotary embedding, plus "sliding" where the
    model rotates its sliding-window layers with frequencies of their own (Gemma 3)."""
    if hasattr(rot, "full_attention_inv_freq"):
        return {kind: (getattr(rot, f"{name}_inv_freq").detach().float().cpu(),
                       float(getattr(rot, f"{name}_attention_scaling", 1.0)))
                for kind, name in (("full", "full_attention"), ("sliding", "sliding_attention"))
                if hasattr(rot, f"{name}_inv_freq")}
    return {"full": (rot.inv_freq.detach().float().cpu(), float(getattr(rot, "attention_scaling", 1.0)))}


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def _load_hf(path, dtype: torch.dtype):
    """The checkpoint on the CPU in the serving dtype; weights move to the device one at a time."""
    from quantserve.modeling import load_model

    return load_model(Path(path), dtype=str(dtype).removeprefix("torch."), device="cpu")


def _hf_tensors(hf_model) -> Weights:
    """The tensors of a loaded Hugging Face model, with its config and rope."""
    sd = hf_model.state_dict()
    if "lm_head.weight" not in sd:  # tied embeddings
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return Weights(sd.__getitem__, sd.__contains__, hf_model.config, _rope_of(hf_model.model.rotary_emb))


def _random_tensors(cfg, device, dtype, seed: int = 0) -> Weights:
    """Fresh random weights of the right shapes (benchmarks: no checkpoint, no CPU RAM; each
    weight exists in fp16 only until it is quantized)."""
    a = ModelArgs.from_hf(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    shapes = {"q_proj": (q, a.dim), "k_proj": (kv, a.dim), "v_proj": (kv, a.dim), "o_proj": (a.dim, q),
              "qkv_proj": (q + 2 * kv, a.dim), "gate_proj": (a.ffn_dim, a.dim), "up_proj": (a.ffn_dim, a.dim),
              "gate_up_proj": (2 * a.ffn_dim, a.dim), "down_proj": (a.dim, a.ffn_dim)}

    def get(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):  # q_norm / k_norm (Qwen3) are per head
            width = a.head_dim if name.endswith(("q_norm.weight", "k_norm.weight")) else a.dim
            return torch.ones(width, device=device, dtype=dtype)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = (a.vocab_size, a.dim)
        else:
            shape = shapes[name.split(".")[-2]]
        if name.endswith(".bias"):
            return torch.zeros(shape[0], device=device, dtype=dtype)
        return torch.randn(shape, device=device, dtype=dtype, generator=gen) * 0.02

    has = lambda name: not name.endswith(".bias") or a.qkv_bias  # noqa: E731
    inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim))
    return Weights(get, has, cfg, {"full": (inv_freq, 1.0)})


def _checkpoint_tensors(folder: Path, dtype: torch.dtype, device: torch.device) -> Weights | None:
    """A plain checkpoint's tensors straight from its safetensors files, each one read when the
    model is built and cast to `dtype`: no transformers model on the CPU first, which took most of
    a warm start (24 s of 38 for the 8B shape on an H200).  None when the files do not name the
    tensors the architecture table expects (a legacy or wrapped layout): transformers loads those
    and maps the names."""
    from quantserve.quant.prequantized import tensor_getter

    raw, names = tensor_getter(folder)
    names = set(names)
    cfg, rope = _config_and_rope(folder)
    arch = ARCHITECTURES.get(cfg.model_type)
    first = [f"model.layers.0.{name}.weight" for theirs in (arch.linears.values() if arch else ()) for name in theirs]
    tied_or_given = "lm_head.weight" in names or getattr(cfg, "tie_word_embeddings", False)
    if arch is None or not tied_or_given or not {"model.embed_tokens.weight", *first} <= names:
        return None

    def read(name: str) -> torch.Tensor:  # backed by the file's pages (a private mapping)
        if name == "lm_head.weight" and name not in names:  # tied embeddings
            name = "model.embed_tokens.weight"
        return raw(name)

    # a copy, always: nothing the model keeps may be backed by the file (rewritten later)
    ahead = ReadAhead(read, pinned=device.type == "cuda")

    def get(name: str) -> torch.Tensor:
        host = ahead.take(name)
        if host is None:  # not planned: read here; for a GPU the copy to the device is the copy
            t = read(name)
            return t.to(device=device if device.type == "cuda" else "cpu",
                        dtype=dtype if t.is_floating_point() else t.dtype, copy=True)
        if device.type == "cuda":
            host = host.to(device, non_blocking=True)  # from pinned memory: a DMA the build overlaps
        return host.to(dtype) if host.is_floating_point() else host

    return Weights(get, lambda name: name in names, cfg, rope, read_ahead=ahead)


def _config_and_rope(folder: Path, drop_quantization: bool = False):
    """The folder's HF config and rotary frequencies, from the model class's own rotary embedding
    (built from the config on a skeleton with no weights).

    The frequencies are kept in the cache, keyed by the config's bytes and the library versions,
    so a later start imports no model classes (nothing else in a checkpoint's start needs them):
    0.6 s of a warm start on a 2-core CPU; no difference measured on the H200 machine, whose file
    cache held the classes (bench/RESULTS.md, 2026-12-05)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    if drop_quantization and hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the structure alone: no quantizer is asked for
    cached = _rope_cache_file(folder)
    if cached is not None and cached.is_file():
        try:
            return cfg, torch.load(cached, weights_only=True)
        except Exception:  # a torn or foreign file: rebuild it below
            pass
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    rope = _rope_of(type(skeleton.model.rotary_emb)(cfg))  # built for real, outside the meta device
    if cached is not None:
        _save_atomically(rope, cached)
    return cfg, rope


def _rope_cache_file(folder: Path) -> Path | None:
    import hashlib

    import transformers

    from quantserve.settings import cache_dir

    try:
        config = (folder / "config.json").read_bytes()
    except OSError:
        return None
    key = hashlib.sha256(config + f"{transformers.__version__} {torch.__version__}".encode()).hexdigest()[:24]
    return cache_dir() / "rope" / f"{key}.pt"


def _save_atomically(rope: dict, path: Path) -> None:
    """Write `rope` at `path` whole or not at all (as triton_mm.save_choices does; the pid keeps two
    servers starting at once apart); a cache that cannot be written is no error."""
    import os

    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rope, tmp)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _prequantized(folder: Path):
    from quantserve.quant.prequantized import quantization_config

    return quantization_config(folder) if (folder / "config.json").is_file() else None


def _prequantized_tensors(folder: Path, keep_int4: bool) -> Weights:
    """An AWQ / GPTQ checkpoint: its 4-bit layers as PackedInt4 (for int4 serving: the
    checkpoint's own integers, no second quantization) or dequantized, the rest as stored.  The
    rotary frequencies come from the model class's own rotary embedding, built from the config."""
    from quantserve.quant.prequantized import dequantize, linear_int4, quantized_layers, tensor_getter

    q = _prequantized(folder)
    raw, names = tensor_getter(folder)
    layers = set(quantized_layers(names))
    cfg, rope = _config_and_rope(folder, drop_quantization=True)

    def get(name: str):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in layers:
            if keep_int4:
                return PackedInt4(*linear_int4(raw, prefix, q), q["group_size"])
            return dequantize(raw, prefix, q)
        if name == "lm_head.weight" and name not in names:  # tied embeddings
            return raw("model.embed_tokens.weight")
        return raw(name)

    def has(name: str) -> bool:
        return name in names or (name.endswith(".weight") and name.removesuffix(".weight") in layers)

    return Weights(get, has, cfg, rope, q)
