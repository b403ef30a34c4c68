"""A byte-level BPE tokenizer trained on the default corpus, saved as a Hugging Face tokenizer.

Byte-level BPE with the GPT-2 pre-tokenizer regex is what llama.cpp calls `gpt2` / `gpt-2`, so
the GGUF files we write tokenize exactly as transformers does.  The chat template is ChatML, which
every serving engine knows.
"""

from __future__ import annotations

from typing import Iterable

BOS, EOS, PAD, IM_START = "<s>", "<|im_end|>", "<pad>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START]  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Train the BPE on `texts` and wrap it as a `PreTrainedTokenizerFast`.

    Plain text gets a BOS automatically (like Llama); chat text rendered by the template already
    carries it, so tokenize that with `add_special_tokens=False`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def render_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
