"""Hugging Face checkpoint → GGUF (F32, F16 or Q8_0), written with the `gguf` package's GGUFWriter.

The three things a GGUF converter gets wrong without failing loudly, and what this one does:

* tensor names: mapped with gguf's own `TensorNameMap` (`model.layers.N.self_attn.q_proj` →
  `blk.N.attn_q`, ...), so names follow whatever llama.cpp release the package matches;
* rotary layout: Hugging Face Llama rotates *halves* of each head, llama.cpp's `llama` graph
  rotates *interleaved pairs*; Q rows are permuted per head with n_head, K rows with n_kv_head
  (grouped-query attention).  The other families run llama.cpp's NEOX rotation, which is the
  halves layout: no permutation there (gguf_architectures.py: what each family's graph expects);
* metadata: every hyper-parameter the graph reads (rope base, norm epsilon, head counts, ...) plus
  the full tokenizer (gguf_vocab.py).

Norms and other 1-D tensors stay F32, as llama.cpp expects.  Q8_0 blocks come from
`gguf.quants.quantize`, which is bit-exact with ggml's own quantizer.
"""

from __future__ import annotations

from pathlib import Path

from quantserve.formats import GGUF_FILE
from quantserve.quant.gguf_architectures import gguf_architecture
from quantserve.quant.source import Checkpoint
from quantserve.settings import UserError

# our format name → (gguf file type, the ggml type of 2-D weight matrices)
OUTTYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}


def permute_rotary(w, n_head: int):
    """Rows of a Q or K projection from HF's rotate-half order to llama.cpp's interleaved order."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


def hyperparameters(ckpt: Checkpoint) -> dict:
    """The config values the llama.cpp graph needs, checked for what we cannot represent."""
    c = ckpt.text_config
    try:
        n_head = int(c["num_attention_heads"])
        hp = {
            "n_layer": int(c["num_hidden_layers"]),
            "n_embd": int(c["hidden_size"]),
            "n_ff": int(c["intermediate_size"]),
            "n_head": n_head,
            "n_kv_head": int(c.get("num_key_value_heads") or n_head),
            "n_vocab": int(c["vocab_size"]),
            "n_ctx": int(c.get("max_position_embeddings") or 2048),
            "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{ckpt.origin}/config.json lacks or mangles a required field ({e})") from e
    hp["head_dim"] = int(c.get("head_dim") or hp["n_embd"] // n_head)
    # transformers ≥5 keeps rope settings in `rope_parameters`; 4.x at the top level.
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    local_rope = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers'
        rope = rope["full_attention"]
    hp["rope_theta"] = float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise UserError(f"{ckpt.origin}: rope scaling {rope_type!r} is not supported by this converter "
                        "(supported: none, linear)")
    hp["rope_linear_factor"] = float(rope.get("factor", 1.0)) if rope_type == "linear" else None
    if float(c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError(f"{ckpt.origin}: partial rotary embeddings are not supported")
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    record = gguf_architecture(ckpt)
    record.hparams(ckpt, c, hp, window, local_rope)
    # tied when the config says so, or when there is no lm_head to write: a config may leave the
    # key to its class's default (Gemma's is True, and its published config.json has no such key)
    hp["tied_embeddings"] = bool(c.get("tie_word_embeddings", False)) or not _has_lm_head(ckpt)
    if record.tied_output and not hp["tied_embeddings"]:
        raise UserError(f"{ckpt.origin}: its lm_head is its own matrix, but llama.cpp's "
                        f"{record.name} graph takes the logits from the embedding "
                        "(tie_word_embeddings, as the published checkpoints have it)")
    return hp


def _has_lm_head(ckpt: Checkpoint) -> bool:
    from quantserve.quant.source import check_safetensors

    return any("lm_head.weight" in check_safetensors(f) for f in ckpt.weight_files)


def _read_tensors(files: list[Path]):
    """(name, float32 numpy array) for every tensor, one at a time (bf16/fp16 upcast via torch).

    Each is checked for NaN / Inf while it is in memory anyway: numpy would quantize them with
    a warning, and llama.cpp's quantizer fails on them without saying why."""
    import torch
    from safetensors import safe_open

    from quantserve.modeling import check_finite

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                data = st.get_tensor(name).to(torch.float32).numpy()
                check_finite(name, data)
                yield name, data


def write_gguf(ckpt: Checkpoint, out_file: Path, outtype: str, progress: bool = False) -> dict:
    """Write `ckpt` as one GGUF file; return a summary for the manifest."""
    import gguf
    import numpy as np

    from quantserve.progress import bars_wanted
    from quantserve.quant.gguf_vocab import add_tokenizer

    if outtype not in OUTTYPES:
        raise UserError(f"unknown GGUF output type {outtype!r} (known: {', '.join(OUTTYPES)})")
    record = gguf_architecture(ckpt)
    arch_name = record.name
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    hp = hyperparameters(ckpt)
    file_type, matrix_type = OUTTYPES[outtype]
    qtype = gguf.GGMLQuantizationType[matrix_type]

    writer = gguf.GGUFWriter(str(out_file), arch_name)
    writer.add_name(ckpt.origin.name)
    writer.add_context_length(hp["n_ctx"])
    writer.add_embedding_length(hp["n_embd"])
    writer.add_feed_forward_length(hp["n_ff"])
    writer.add_block_count(hp["n_layer"])
    writer.add_head_count(hp["n_head"])
    writer.add_head_count_kv(hp["n_kv_head"])
    if hp["head_dim"] != hp["n_embd"] // hp["n_head"]:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_rope_dimension_count(hp["head_dim"])
    writer.add_rope_freq_base(hp["rope_theta"])
    if hp["rope_linear_factor"]:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(hp["rope_linear_factor"])
    writer.add_layer_norm_rms_eps(hp["norm_eps"])
    if record.sliding_window:
        writer.add_sliding_window(hp["sliding_window"])
        if hp["attn_softcap"]:
            writer.add_attn_logit_softcapping(float(hp["attn_softcap"]))
        if hp["final_softcap"]:
            writer.add_final_logit_softcapping(float(hp["final_softcap"]))
    writer.add_vocab_size(hp["n_vocab"])
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokenizer = add_tokenizer(writer, ckpt.path, hp["n_vocab"])

    names = gguf.get_tensor_name_map(arch, hp["n_layer"])
    wanted = {"attn_q": hp["n_head"], "attn_k": hp["n_kv_head"]}
    types: dict[str, int] = {}
    fallbacks: list[tuple[str, str, int]] = []  # (GGUF name, type written, row length)
    count = 0
    tensors = _read_tensors(ckpt.weight_files)
    if progress:
        from quantserve.progress import track

        tensors = track(tensors, f"converting to GGUF {outtype.upper()}", "tensor")
    for hf_name, data in tensors:
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by llama.cpp from rope.freq_base
        if hf_name == "lm_head.weight" and hp["tied_embeddings"]:
            continue  # llama.cpp reuses token_embd when `output` is absent
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UserError(f"{ckpt.origin}: tensor {hf_name!r} has no GGUF name for {arch_name}")
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if record.permute_qk and kind in wanted:
            data = permute_rotary(data, wanted[kind])
        if record.norms_plus_one and hf_name.endswith("norm.weight"):
            data = data + 1.0
        if data.ndim == 1:
            writer.add_tensor(name, data.astype(np.float32))
            types[name] = int(gguf.GGMLQuantizationType.F32)
        elif qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            types[name] = int(qtype)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data.astype(np.float32))
            types[name] = int(qtype)
        else:  # F16, and Q8_0's fallback for rows that are not whole 32-wide blocks
            writer.add_tensor(name, _to_f16(hf_name, data))
            types[name] = int(gguf.GGMLQuantizationType.F16)
            if qtype == gguf.GGMLQuantizationType.Q8_0:
                fallbacks.append((name, "F16", data.shape[-1]))
        count += 1

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=bars_wanted(progress))  # gguf's own tqdm bar: a terminal only
    writer.close()
    note_fallbacks(fallbacks, matrix_type, 32)
    type_counts: dict[str, int] = {}
    for t in types.values():
        type_counts[gguf.GGMLQuantizationType(t).name] = type_counts.get(gguf.GGMLQuantizationType(t).name, 0) + 1
    return {"architecture": arch_name, "tensors": count, "tensor_types": type_counts,
            "hyperparameters": hp, "tokenizer": tokenizer}


def _to_f16(name: str, data):
    """`data` as float16; finite values past F16's range (±65504) would become Inf silently."""
    import numpy as np

    half = data.astype(np.float16)
    if not np.isfinite(half).all():
        raise UserError(f"tensor {name!r} holds values beyond F16's range (±65504), which F16 and "
                        "the k-quants (made from F16) cannot hold: use gguf-f32 or gguf-q8_0")
    return half


def note_fallbacks(fallbacks: list[tuple[str, str, int]], wanted: str, block: int) -> None:
    """Say on stderr which tensors were written in another type than the format's, and why, as
    llama-quantize does: the output is valid, but not the size or quality the format name says."""
    import sys

    if not fallbacks:
        return
    written = sorted({t for _, t, _ in fallbacks})
    rows = sorted({n for _, _, n in fallbacks})
    names = [name for name, _, _ in fallbacks]
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    print(f"note: {len(names)} tensor{'s' if len(names) > 1 else ''} written as {'/'.join(written)} "
          f"instead of {wanted}: rows of {', '.join(map(str, rows))} values are not whole {block}-value "
          f"{wanted} blocks ({shown})", file=sys.stderr, flush=True)


# llama.cpp's k-quant blocks hold 256 values per row segment, its legacy ones 32
_KQUANT_TARGET = {"q2_k": ("Q2_K", 256), "q3_k_m": ("Q3_K", 256), "q4_0": ("Q4_0", 32),
                  "q4_k_s": ("Q4_K", 256), "q4_k_m": ("Q4_K", 256), "q5_0": ("Q5_0", 32),
                  "q5_k_s": ("Q5_K", 256), "q5_k_m": ("Q5_K", 256), "q6_k": ("Q6_K", 256)}


def kquant_fallbacks(path: Path, kind: str) -> list[tuple[str, str, int]]:
    """The 2-D tensors llama.cpp wrote in another type because their rows are not whole blocks of
    the format's type (its mixes also pick other types on purpose: those are not listed)."""
    from gguf import GGUFReader

    wanted, block = _KQUANT_TARGET[kind]
    out = []
    for t in GGUFReader(str(path)).tensors:
        row = int(t.shape[0])  # GGUF lists the row length (ne0) first
        if len(t.shape) >= 2 and row % block and t.tensor_type.name != wanted:
            out.append((t.name, t.tensor_type.name, row))
    return out


# The writers `quant convert` calls for the GGUF formats (quantserve/formats.py names them):
# each writes GGUF_FILE into the output folder and returns the manifest's summary.

def write_gguf_folder(ckpt: Checkpoint, out_dir: Path, outtype: str, progress: bool = False) -> dict:
    """F32 / F16 / Q8_0: written by our own writer."""
    return write_gguf(ckpt, out_dir / GGUF_FILE, outtype, progress)


def write_kquant(ckpt: Checkpoint, out_dir: Path, kind: str, progress: bool = False) -> dict:
    """k-quants: our F16 GGUF first, then llama.cpp's quantizer; only the quantized file is kept."""
    from quantserve.quant.inspect import gguf_tensor_types
    from quantserve.quant.llamacpp_worker import quantize

    f16 = out_dir / ".model-f16.gguf"
    summary = write_gguf(ckpt, f16, "f16", progress)
    if progress:
        print(f"quantizing with llama.cpp to {kind.upper()} ...", flush=True)
    quantize(f16, out_dir / GGUF_FILE, kind)
    f16.unlink()
    # llama.cpp falls back to other types for rows that are not whole 256-wide super-blocks;
    # record what each tensor really became.
    summary["tensor_types"] = gguf_tensor_types(out_dir / GGUF_FILE)
    if kind in _KQUANT_TARGET:
        fallbacks = kquant_fallbacks(out_dir / GGUF_FILE, kind)
        note_fallbacks(fallbacks, *_KQUANT_TARGET[kind])
        summary["fallback_tensors"] = {name: t for name, t, _ in fallbacks}
    summary["quantizer"] = f"llama.cpp llama_model_quantize ({kind.upper()}) from our F16 GGUF"
    return summary
