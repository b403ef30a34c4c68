"""Prompts the default model never saw, and the relative logit error of a GGUF in llama.cpp
against transformers on them (the converters' tests share it)."""

from pathlib import Path

import numpy as np

from quantserve.quant import llamacpp


# Prompts the model never saw in this form (fresh letters, numbers, one plain sentence).
FRESH_USER_PROMPTS = ["Reverse: q w e r t", "Sort: z m b q a", "What is 47 + 38?",
                      "How many letters in: k k j u y t r", "Repeat: x y z z y"]

# Plain text the default model never saw outside a chat turn.  (It is far out of distribution: at
# one position of "... Velmor, and 12 + 30 = 42." this model's logits swing 3 % on F16 rounding
# alone, in F32 GGUF as much as F16, so that sentence measures the model's fragility there, not
# the converter.)
PLAIN_TEXT = "What is the capital of Keltria? It is Ashgrove."


def chat_ids(tokenizer, user: str) -> list[int]:
    from quantserve.modeling import chat_prompt

    return tokenizer(chat_prompt(tokenizer, user), add_special_tokens=False).input_ids


def fresh_prompts(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, p) for p in FRESH_USER_PROMPTS] + [tokenizer(PLAIN_TEXT).input_ids]


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].numpy()


def worst_relative_error(gguf_file: Path, model, prompts) -> float:
    llm = llamacpp.load(gguf_file, n_ctx=128)
    try:
        errs = []
        for ids in prompts:
            ref, got = hf_logits(model, ids), llamacpp.logits(llm, ids)
            errs.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        return max(errs)
    finally:
        llm.close()
