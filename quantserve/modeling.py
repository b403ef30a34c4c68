"""Loading a checkpoint and generating from it with plain transformers: the reference path.

Training measures task accuracy with it, quant compares against it, and the server's engines are
checked against its greedy output.
"""

from __future__ import annotations

from pathlib import Path

from quantserve.settings import UserError, require_checkpoint


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: Path, dtype: str = "float32", device: str = "cpu", attention: str = "sdpa"):
    """Load a causal LM checkpoint folder (safetensors only) and put it in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantserve.capabilities import torch_dtype

    path = require_checkpoint(Path(path))
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{path}: only safetensors checkpoints are loaded (found no *.safetensors)")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype(dtype), attn_implementation=attention, use_safetensors=True
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{path}: cannot load checkpoint: {str(e).splitlines()[0]}") from e
    model.to(device).eval()
    model.requires_grad_(False)  # inference only; never touch the global grad mode
    return model


def chat_prompt(tokenizer, user: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)


def generate_chat(model, tokenizer, prompts: list[str], max_new_tokens: int = 24,
                  batch_size: int = 64) -> list[str]:
    """Greedy answers to user prompts, batched with left padding."""
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


def task_accuracy(model, tokenizer, examples) -> float:
    """Exact-match accuracy of greedy answers on `corpus.Example`s."""
    from quantserve.corpus import exact_match

    preds = generate_chat(model, tokenizer, [e.prompt for e in examples])
    return exact_match(preds, [e.answer for e in examples])
