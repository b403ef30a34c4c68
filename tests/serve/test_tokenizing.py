"""Long prompts are tokenized off the event loop (server/tokenizing.py), on the default model's real
tokenizer: the ids equal the tokenizer's own, under concurrency and beside decoding, and only
long texts from a thread-safe tokenizer leave the loop."""

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

    def encode(self, text, add_special_tokens):
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


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
