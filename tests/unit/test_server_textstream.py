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


def test_the_rust_incremental_decoder_gives_what_the_window_decoder_gives(tokenizer):
    """Where the tokenizer offers `decode_stream` (the Rust decoder), every token's released text
    equals the window method's (vLLM's), over random ids that split characters and hold special
    tokens; both together equal the whole decode."""
    import random

    from quantserve.server.textstream import IncrementalDetokenizer

    class WindowOnly:  # the same tokenizer without the Rust stream (as the gguf engine's)
        decode = tokenizer.decode

    assert tokenizer.decode_stream([1]) is not None
    rng = random.Random(0)
    prompt = tokenizer.encode("Repeat:", add_special_tokens=True)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(60)]
        fast, slow = IncrementalDetokenizer(tokenizer, prompt), IncrementalDetokenizer(WindowOnly(), prompt)
        pieces = [(fast.push(t), slow.push(t)) for t in ids]
        assert [f for f, _ in pieces] == [s for _, s in pieces]
        assert fast.flush() == slow.flush()
        assert "".join(f for f, _ in pieces) + "" == "".join(s for _, s in pieces)


def _job_with_events(tokenizer, events):
    """A one-choice Job whose stream already holds `events` (as when the loop was busy while a
    step's tokens came), on the running loop."""
    import asyncio

    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.sampling import SamplingParams
    from quantserve.server.serving import Job

    class Engine:  # the stream's cancel() reaches it
        def cancel(self, request_id):
            pass

    prompt = tokenizer.encode("Repeat:", add_special_tokens=True)
    stream = TokenStream(EngineRequest(prompt, SamplingParams(max_tokens=16)), asyncio.get_running_loop(), Engine())
    for event in events:
        stream.deliver(event)
    return Job([stream], [ChoiceText(tokenizer, prompt, [], want_logprobs=True)], prompt_tokens=len(prompt))


def test_events_that_wait_go_out_as_one_delta_and_an_error_after_the_text(tokenizer):
    """What came while the loop was busy is one delta (one chunk to send), the same text and
    logprob entries as token by token; an error event still follows the text before it."""
    import asyncio
    from types import SimpleNamespace

    from quantserve.server.exceptions import EngineError
    from quantserve.server.metrics import Metrics
    from quantserve.server.serving import run_job

    ids = tokenizer.encode("a b c d", add_special_tokens=False)
    state = SimpleNamespace(metrics=Metrics(SimpleNamespace(stats=lambda: None)))

    async def deltas(events):
        job = _job_with_events(tokenizer, events)
        return [d async for _, d in run_job(state, job)], job

    got, job = asyncio.run(deltas([TokenEvent(t, logprob=-0.5) for t in ids[:-1]] +
                                  [TokenEvent(ids[-1], logprob=-0.5, finish_reason="length")]))
    assert len(got) == 1 and got[0].text == "a b c d" == job.choices[0].text
    assert len(got[0].logprobs) == len(ids) and got[0].finish_reason == "length"
    got, _ = asyncio.run(deltas([TokenEvent(t) for t in ids[:2]] +
                                [TokenEvent(None, finish_reason="error", error=EngineError("boom"))]))
    assert [(d.text, d.finish_reason) for d in got] == [(tokenizer.decode(ids[:2]), None), ("", "error")]
