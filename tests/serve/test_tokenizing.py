"""Long prompts are tokenized off the event loop, the requests of one turn of the loop in one batch
(server/tokenizing.py), on the default model's real tokenizer: the ids equal the tokenizer's own,
under concurrency and beside decoding; a text that fails fails its own request only; only long
texts from a thread-safe tokenizer leave the loop."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from quantserve.server.hf_engine import HFTokenizer
from quantserve.server.tokenizing import OFF_LOOP_CHARS, encode_all


class _Recording(HFTokenizer):
    """The real tokenizer, noting the thread each encode ran on."""

    def __init__(self, tok):
        super().__init__(tok)
        self.threads: list[str] = []
        self.batches: list[int] = []  # texts per batch encode

    def encode(self, text, add_special_tokens):
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)

    def encode_batch(self, texts, add_special_tokens):
        self.threads.append(threading.current_thread().name)
        self.batches.append(len(texts))
        return super().encode_batch(texts, add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from quantserve.modeling import load_tokenizer

    return load_tokenizer(default_model)


def _texts(n: int, chars: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["sort", "the", "list", "ünïcödé", "数字", "🙂", "\n", "reverse:", "a", "b", "</s>", "<s>", "  "]
    out = []
    for _ in range(n):
        text = ""
        while len(text) < chars:
            text += rng.choice(words) + " "
        out.append(text)
    return out


def test_long_prompts_encode_on_worker_threads_to_the_same_ids(tokenizer):
    texts = _texts(32, OFF_LOOP_CHARS + 500)
    expected = [tokenizer(t, add_special_tokens=special).input_ids for t in texts for special in (True, False)]
    rec = _Recording(tokenizer)

    async def main():
        loop_thread = threading.current_thread().name
        # 64 encodes at once, while the loop also decodes (as it does for running streams)
        calls = [encode_all(rec, [t], add_special_tokens=special) for t in texts for special in (True, False)]
        decoded = [asyncio.to_thread(lambda ids=ids: rec.decode(ids)) for ids in expected[:8]]
        got = await asyncio.gather(*calls, *decoded)
        return loop_thread, [g[0] for g in got[:len(calls)]]

    loop_thread, got = asyncio.run(main())
    assert got == expected
    assert rec.threads and all(name.startswith("quantserve-tokenize") for name in rec.threads)
    assert loop_thread not in rec.threads
    # the 64 requests of one turn of the loop went in two batches, one per add_special_tokens
    assert sorted(rec.batches) == [32, 32]


def test_a_text_that_fails_fails_its_own_request_only(tokenizer):
    class FailsOnBad(_Recording):
        def encode(self, text, add_special_tokens):
            if "BAD" in text:
                raise ValueError("cannot encode this text")
            return super().encode(text, add_special_tokens)

        def encode_batch(self, texts, add_special_tokens):
            if any("BAD" in t for t in texts):
                raise ValueError("cannot encode this batch")
            return super().encode_batch(texts, add_special_tokens)

    texts = _texts(6, OFF_LOOP_CHARS + 100)
    texts[2] += "BAD"
    rec = FailsOnBad(tokenizer)

    async def main():
        return await asyncio.gather(*(encode_all(rec, [t], add_special_tokens=True) for t in texts),
                                    return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[2], ValueError)
    assert [g[0] for i, g in enumerate(got) if i != 2] == [tokenizer(t).input_ids for i, t in enumerate(texts) if i != 2]


def test_short_prompts_and_other_tokenizers_stay_on_the_loop(tokenizer):
    rec = _Recording(tokenizer)
    short = _texts(3, 40)
    loop_thread, got = asyncio.run(_encode_on_a_loop(rec, short))
    assert got == [tokenizer(t).input_ids for t in short] and set(rec.threads) == {loop_thread}

    class NotThreadSafe(_Recording):  # llama.cpp's tokenizer in the gguf engine says nothing
        thread_safe = False

    other = NotThreadSafe(tokenizer)
    loop_thread, _ = asyncio.run(_encode_on_a_loop(other, _texts(4, OFF_LOOP_CHARS + 10)))
    assert set(other.threads) == {loop_thread}


async def _encode_on_a_loop(tok, texts):
    return threading.current_thread().name, await encode_all(tok, texts, add_special_tokens=True)


def test_the_line_moves_down_with_the_cores_and_the_setting_wins(monkeypatch):
    from quantserve.server import tokenizing

    monkeypatch.delenv("QUANTSERVE_OFF_LOOP_CHARS", raising=False)
    monkeypatch.setattr(tokenizing.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    assert tokenizing._off_loop_chars() == 8192
    monkeypatch.setattr(tokenizing.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert tokenizing._off_loop_chars() == 1024
    monkeypatch.setenv("QUANTSERVE_OFF_LOOP_CHARS", "3000")
    assert tokenizing._off_loop_chars() == 3000


def test_two_event_loops_at_once_each_get_their_own_answers(tokenizer):
    """Each loop's batch is its own (a replica's loop and a test client's, say): the same ids on both."""
    texts = _texts(16, OFF_LOOP_CHARS + 50, seed=3)
    expected = [tokenizer(t).input_ids for t in texts]
    rec = _Recording(tokenizer)
    got: dict[int, list] = {}

    async def one(k: int):
        got[k] = [r[0] for r in await asyncio.gather(*(encode_all(rec, [t], add_special_tokens=True) for t in texts))]

    threads = [threading.Thread(target=lambda k=k: asyncio.run(one(k))) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: expected, 1: expected}
