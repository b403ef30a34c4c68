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
    def load(attn: str):
        # use_safetensors=True: transformers never falls back to a pickle; None lets it when trusted
        return AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype(dtype), attn_implementation=attn,
            use_safetensors=None if trust_pickle else True,
            disable_mmap=True,  # weights read into memory: a file overwritten later cannot change them
        )

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
