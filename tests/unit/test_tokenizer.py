"""The default tokenizer: byte-level BPE round trips, chat template, special tokens, save/reload."""

import pytest

from quantserve.demo import corpus
from quantserve.demo.default_model import corpus_text
from quantserve.demo.tokenizer import BOS, EOS, IM_START, PAD, SPECIAL_TOKENS, render_chat, train_tokenizer

TRICKY = [
    "Sort: d a c b", "  two  leading spaces", "tabs\tand\nnewlines\n\n", "digits 1234567890 3.14",
    "unicode: héllo wörld – ça va? 日本語 🙂👍🏽", "", " ", "<|im_end|> inside text",
    "mixed CASE and ALLCAPS", "emoji split 🙂🙂🙂 across merges",
]


@pytest.fixture(scope="module")
def tok():
    train = corpus.pretrain_examples(3000) + corpus.task_examples(300, "train")
    return train_tokenizer([corpus_text(e) for e in train], vocab_size=512)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text


def test_bos_is_added_for_plain_text_only(tok):
    ids = tok("Repeat: a b").input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_special_tokens_have_fixed_ids_and_are_atomic(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    ids = tok(f"{IM_START}user\nhi{EOS}", add_special_tokens=False).input_ids
    assert ids[0] == 3 and ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("skill", ["sort", corpus.TOOL_SKILL])
def test_chat_template_renders_bos_plus_corpus_text(tok, skill):
    ex = corpus.examples([skill], 1, seed=0)[0]
    assert render_chat(tok, ex.messages()) == BOS + corpus_text(ex)
    prompt = render_chat(tok, ex.request(), add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_single_letters_stay_single_tokens(tok):
    # the letter skills rely on one bare token per letter, in prompts and answers alike
    prompt = tok.tokenize("Sort:\nd a c b")
    answer = tok.tokenize("a b c d")
    assert prompt[-4:] == ["d", "Ġa", "Ġc", "Ġb"] and answer == ["a", "Ġb", "Ġc", "Ġd"]


def test_save_and_reload_is_identical(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in TRICKY:
        assert again(text).input_ids == tok(text).input_ids
    assert again.chat_template == tok.chat_template
    assert again.eos_token == EOS and again.pad_token == PAD
