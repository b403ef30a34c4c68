"""Loading a checkpoint and generating from it with plain transformers: the reference path.

Training measures task accuracy with it, quant compares against it, and the server's engines are
checked against its greedy output.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from quantserve.settings import UserError, require_checkpoint

# Weight files that are Python pickles: unpickling runs code chosen by whoever wrote the file, so a
# downloaded checkpoint in this form is refused unless the user says it is trusted.
PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# pickles a training run leaves next to safetensors weights; never loaded by anything here
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"}


def pickle_weights(folder: Path) -> list[Path]:
    """Pickle weight files in a checkpoint folder (training-state pickles left out)."""
    found = {f for pattern in PICKLE_WEIGHTS for f in Path(folder).glob(pattern)}
    return sorted(f for f in found if f.is_file() and f.name not in _NOT_WEIGHTS)


def weights_problem(folder: Path, trust_pickle: bool = False) -> tuple[str, bool] | None:
    """Why a checkpoint's weights are refused, or None: (the problem, whether trusting pickles
    would let them load).  The callers add their remedy (a flag, a re-save)."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")) or trust_pickle:
        return None
    pickles = pickle_weights(folder)
    if pickles:
        names = ", ".join(p.name for p in pickles[:3]) + (" ..." if len(pickles) > 3 else "")
        return (f"{folder}: weights are pickle files ({names}), which can run code when loaded; "
                "only safetensors are loaded"), True
    return f"{folder}: no *.safetensors weight files", False


def require_safetensors(folder: Path, trust_pickle: bool = False) -> None:
    """Refuse a checkpoint whose weights are only pickles (one clear line), unless trusted."""
    problem = weights_problem(folder, trust_pickle)
    if problem:
        text, trusting_helps = problem
        raise UserError(f"{text}: if you trust its source, re-save it with save_pretrained(safe_serialization=True)"
                        if trusting_helps else text)


def safetensors_copy(folder: Path, out: Path) -> Path:
    """Rewrite a trusted pickle checkpoint as safetensors in `out` (config and tokenizer copied).

    Every loader downstream then stays safetensors-only; the pickle is read once, here, by
    transformers (torch.load with weights_only=True).
    """
    from transformers import AutoModelForCausalLM

    folder, out = Path(folder), Path(out)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", use_safetensors=False)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{folder}: cannot load the pickle checkpoint: {str(e).splitlines()[0]}") from e
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    weights = set(pickle_weights(folder)) | set(folder.glob("*.bin.index.json"))
    for f in folder.iterdir():
        if f.is_file() and f not in weights and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)  # tokenizer, chat template, ...
    return out


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: Path, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa",
               trust_pickle: bool = False):
    """Load a causal LM checkpoint folder (safetensors only, unless `trust_pickle`) in eval mode."""
    from transformers import AutoModelForCausalLM

    from quantserve.capabilities import torch_dtype

    path = require_checkpoint(Path(path))
    require_safetensors(path, trust_pickle)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        check_checkpoint(path)  # config vs. weights, from the headers: before any weight is read

    def load(attn: str):
        # use_safetensors=True: transformers never falls back to a pickle; None lets it when trusted
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype(dtype), attn_implementation=attn,
            use_safetensors=None if trust_pickle else True,
            disable_mmap=True,  # weights read into memory: a file overwritten later cannot change them
            output_loading_info=True,  # transformers only prints what it initialised at random
        )
        check_loading_info(path, info)
        return model

    try:
        try:
            model = load(attention)
        except ValueError as e:  # e.g. Gemma 2 (soft-capped scores): SDPA refused, eager is exact
            if attention == "eager" or "does not support an attention implementation" not in str(e):
                raise
            model = load("eager")
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path}: cannot load checkpoint: {str(e).splitlines()[0]}") from e
    model.to(device).eval()
    model.requires_grad_(False)  # inference only; never touch the global grad mode
    return model


@contextlib.contextmanager
def reference_run(model):
    """Run an fp32 reference model (held-out accuracy, `quant eval`'s source logits) on the GPU when
    its weights take at most half of the memory this process may still use there — on a CPU a 1B
    model's reference took minutes — else on the CPU.  Full fp32 either way: no TF32, whatever
    training set before."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)  # the T4 profile's cap
        allowed = min(free, get_fraction() * total - torch.cuda.memory_reserved())
        if sum(p.numel() * p.element_size() for p in model.parameters()) <= allowed / 2:
            model.to("cuda")
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield model
    finally:
        torch.set_float32_matmul_precision(saved)


def chat_prompt(tokenizer, user: str | list[dict]) -> str:
    """The prompt text for a user message, or for a conversation (a list of messages)."""
    messages = [{"role": "user", "content": user}] if isinstance(user, str) else user
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generate_chat(model, tokenizer, prompts: list[str | list[dict]], max_new_tokens: int = 24,
                  batch_size: int = 64) -> list[str]:
    """Greedy answers to user prompts (or conversations), batched with left padding."""
    import torch

    tokenizer.padding_side = "left"
    answers: list[str] = []
    for i in range(0, len(prompts), batch_size):
        texts = [chat_prompt(tokenizer, p) for p in prompts[i : i + batch_size]]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        new = out[:, enc.input_ids.shape[1]:]
        answers.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return [a.strip() for a in answers]


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Fraction of predictions equal to their reference after trimming whitespace."""
    if len(predictions) != len(references):
        raise ValueError("predictions and references differ in length")
    if not references:
        return 0.0
    return sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references)


def task_accuracy(model, tokenizer, examples) -> float:
    """Exact-match accuracy of greedy answers on `corpus.Example`s (room for the longest answer)."""
    longest = max(len(tokenizer(e.answer, add_special_tokens=False).input_ids) for e in examples)
    preds = generate_chat(model, tokenizer, [e.request() for e in examples], max_new_tokens=max(24, longest + 4))
    return exact_match(preds, [e.answer for e in examples])


# --- does the checkpoint describe one model? ---------------------------------------------------
# transformers loads a checkpoint whose tensors do not fit its config.json by initialising what is
# missing at random (it prints a MISSING report and carries on), and the GGUF writer copies whatever
# tensors it finds under the hyper-parameters the config gives: a broken model and exit 0 either
# way.  These checks read config.json and the safetensors headers only, so an 8B checkpoint is
# checked as fast as a tiny one; `quant convert`, `train` and `generate` run them before loading.

# Sizes every causal LM config holds where it names them: a zero or negative one crashes deep in
# transformers or the GGUF writer (ZeroDivisionError, "argument out of range").
_POSITIVE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                    # GPT-2's names for the same sizes
                    "n_embd", "n_layer", "n_head", "n_positions", "n_ctx")
_SHOWN = 3  # tensors named per kind of problem: enough to see the pattern, one line still


def check_config(config, where: Path | str) -> None:
    """One UserError naming the field when config.json (`where`) is not an object or holds a size
    that is not a positive integer; a multimodal config's text_config is checked too."""
    if not isinstance(config, dict):
        raise UserError(f"{where}: expected a JSON object, not {type(config).__name__}")
    for part, values in (("", config), ("text_config.", config.get("text_config"))):
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UserError(f"{where}: {part or 'text_config'} must be a JSON object")
        for name in _POSITIVE_FIELDS:
            value = values.get(name)
            if value is None:
                continue  # absent: the architecture's default, or a derived value
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{where}: {part}{name} must be a positive integer, not {value!r}")


def check_config_file(folder: Path) -> dict:
    """config.json of a checkpoint folder, read and checked; returns it."""
    import json

    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e
    check_config(config, path)
    return config


def expected_tensors(folder: Path) -> tuple[dict[str, tuple], list[set[str]], str] | None:
    """The tensors transformers' class for this config holds: name → shape, from a weightless
    (meta-device) skeleton; the groups of names that share one tensor (tied embeddings); and the
    base model's prefix ("transformer" for GPT-2).  None where transformers renames or fuses a
    family's saved tensors as it loads them (MoE experts, multimodal wrappers): their headers
    cannot be compared name by name, and `check_loading_info` checks those after the load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, OSError, ArithmeticError) as e:
        raise UserError(f"{folder}/config.json is not usable: {str(e).splitlines()[0]}") from e
    if _renames_on_load(model):
        return None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    owners: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), set()).add(name)
    return shapes, [names for names in owners.values() if len(names) > 1], model.base_model_prefix


def _renames_on_load(model) -> bool:
    """Whether transformers maps this family's saved names or tensors to others as it loads."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:  # an API that moved: no name-by-name check rather than a false refusal
        return True


def saved_tensors(files: list[Path]) -> dict[str, tuple]:
    """name → shape of every tensor in the safetensors files, from their headers alone."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                shapes.update({name: tuple(st.get_slice(name).get_shape()) for name in st.keys()})
        except Exception as e:  # safetensors' own error class; a corrupt header reads as one line
            raise UserError(f"{f}: cannot read its safetensors header: {str(e).splitlines()[0]}") from e
    return shapes


def _listed(names, n: int = _SHOWN) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def tensors_mismatch(expected: dict[str, tuple], tied: list[set[str]], saved: dict[str, tuple]) -> str | None:
    """What is wrong between the tensors a config implies and those saved, or None."""
    # Of names sharing one tensor, one saved is enough (lm_head absent when tie_word_embeddings).
    optional = {name for group in tied if group & saved.keys() for name in group}
    missing = [n for n in expected if n not in saved and n not in optional]
    # rotary inv_freq: a buffer older transformers saved; every loader recomputes it
    unexpected = [n for n in saved if n not in expected and not n.endswith("rotary_emb.inv_freq")]
    shape = [f"{n} {list(saved[n])} (config: {list(expected[n])})"
             for n in sorted(expected.keys() & saved.keys()) if tuple(saved[n]) != tuple(expected[n])]
    problems = []
    if shape:
        problems.append(f"wrong shape: {_listed(shape)}")
    if missing:
        problems.append(f"missing: {_listed(missing)}")
    if unexpected:
        problems.append(f"not in the model: {_listed(unexpected)}")
    return "; ".join(problems) or None


def check_weights_match(folder: Path, files: list[Path] | None = None) -> None:
    """One UserError when the safetensors in `folder` (or `files`) are not the tensors its
    config.json describes: missing, unexpected or wrong-shaped tensors, the first few named."""
    folder = Path(folder)
    files = files if files is not None else sorted(folder.glob("*.safetensors"))
    if "quantization_config" in check_config_file(folder):
        return  # bitsandbytes / AWQ / GPTQ tensors (SCB, qweight, ...): the load's own report checks them
    skeleton = expected_tensors(folder)
    if skeleton is None:
        return
    expected, tied, prefix = skeleton
    # checkpoints saved from the base model alone (GPT-2's "h.0..." for "transformer.h.0..."), which
    # transformers loads into the LM class by adding its prefix
    saved = {(f"{prefix}.{n}" if prefix and n not in expected and f"{prefix}.{n}" in expected else n): shape
             for n, shape in saved_tensors(files).items()}
    problem = tensors_mismatch(expected, tied, saved)
    if problem:
        raise UserError(f"{folder}: its weights do not match its config.json ({problem})")


def check_checkpoint(folder: Path, files: list[Path] | None = None) -> None:
    """Both checks, config first (a zero-sized field would crash the skeleton's construction):
    check_weights_match reads and checks config.json before it builds anything."""
    check_weights_match(folder, files)


def check_finite(name: str, data) -> None:
    """One UserError naming a tensor with NaN or Inf values; `data` is a numpy array or a torch
    tensor already in memory (the converters check each one as they read it)."""
    import numpy as np

    if isinstance(data, np.ndarray):
        finite = bool(np.isfinite(data).all())
    else:
        import torch
        finite = bool(torch.isfinite(data).all())
    if not finite:
        raise UserError(f"tensor {name!r} holds non-finite values (NaN or Inf): the checkpoint is "
                        "damaged (or a training run diverged); nothing was converted")


def check_loading_info(folder: Path, info: dict) -> None:
    """One UserError from what `from_pretrained(..., output_loading_info=True)` reports: transformers
    only prints its MISSING / UNEXPECTED table and initialises the missing tensors at random.  Its
    accounting already allows tied weights and the keys a class declares ignorable."""
    missing = info.get("missing_keys") or []
    unexpected = [n for n in info.get("unexpected_keys") or [] if not n.endswith("rotary_emb.inv_freq")]
    mismatched = [f"{m[0]} {list(m[1])} (config: {list(m[2])})" if isinstance(m, (tuple, list)) and len(m) == 3
                  else str(m) for m in info.get("mismatched_keys") or []]
    problems = [f"{what}: {_listed(names)}" for what, names in
                (("wrong shape", mismatched), ("missing", missing), ("not in the model", unexpected)) if names]
    if problems:
        raise UserError(f"{folder}: its weights do not match its config.json ({'; '.join(problems)})")
