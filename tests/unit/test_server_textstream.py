"""Incremental detokenization and stop strings, on the default model's real tokenizer: what a
client sees token by token must equal the whole text, never hold U+FFFD halves, never a stop string."""

from __future__ import annotations

import pytest

from quantserve.server.engine import TokenEvent
from quantserve.server.hf_engine import HFTokenizer
from quantserve.server.textstream import ChoiceText, StopMatcher


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from quantserve.modeling import load_tokenizer

    return HFTokenizer(load_tokenizer(default_model))


def _stream(tokenizer, text: str, stop: list[str], finish: str = "length") -> tuple[list[str], ChoiceText]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Repeat:", add_special_tokens=True)
    choice = ChoiceText(tokenizer, prompt, stop, want_logprobs=False)
    pieces = []
    for i, token in enumerate(ids):
        delta = choice.push(TokenEvent(token, finish_reason=finish if i == len(ids) - 1 else None))
        pieces.append(delta.text)
        if delta.finish_reason:
            break
    return pieces, choice


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 日本語 ok 🙂!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "expected byte-level pieces for the non-ASCII characters"
    pieces, choice = _stream(tokenizer, text, [])
    assert "".join(pieces) == text == choice.text
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("stop", ["c d", "ö", "d e f", "x"])
def test_stop_strings_are_cut_even_across_tokens(tokenizer, stop):
    text = "a b c d e f größe"
    pieces, choice = _stream(tokenizer, text, [stop, "never"])
    expected = text[:text.index(stop)] if stop in text else text
    assert "".join(pieces) == expected == choice.text
    assert choice.finish_reason == ("stop" if stop in text else "length")
    assert all(stop not in "".join(pieces[:i + 1]) for i in range(len(pieces)))


def test_stop_matcher_holds_back_only_possible_prefixes():
    m = StopMatcher(["END", "xyz"])
    assert m.push("abcE") == ("abc", False)   # "E" may start "END"
    assert m.push("Nx") == ("EN", False)      # "ENx" cannot become "END"; "x" may start "xyz"
    assert m.push("q") == ("xq", False)
    assert m.push("fooEN") == ("foo", False)
    assert m.push("D tail") == ("", True)
