"""Async scheduling (server/paged_scheduler.py): greedy decode steps launched one ahead of the host
give exactly the tokens of steps run one at a time, through everything that changes a batch: ends
on length and on the end-of-text token, a cancellation, requests arriving mid-stream, preemption.
On the CPU the fast engine runs eagerly, the same code."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.streams import recording_stream


def _scheduler(default_model, async_scheduling: bool, kv_blocks: int | None = None):
    """A fresh paged scheduler on the default model -> (scheduler, backend, tokenizer, launches),
    `launches` counting the steps launched ahead."""
    from quantserve.modeling import load_tokenizer
    from quantserve.server.fastcore.adapter import FastCoreBackend
    from quantserve.server.paged_scheduler import PagedScheduler

    tok = load_tokenizer(default_model)
    backend = FastCoreBackend(default_model, max_batch=4, context_length=512, kv_blocks=kv_blocks)
    sched = PagedScheduler(backend, set(tok.all_special_ids), max_batch=4, max_queue=16,
                           max_batched_tokens=64, async_scheduling=async_scheduling)
    launches = []
    real = backend.launch_greedy
    backend.launch_greedy = lambda *a: launches.append(1) or real(*a)  # counted, then launched for real
    return sched, backend, tok, launches


def _busy_run(default_model, async_scheduling: bool):
    """Requests that end on length and on the end-of-text token, one cancelled mid-stream, and
    two arriving while others decode -> ({label: (tokens, finish)}, steps launched ahead)."""
    sched, backend, tok, launches = _scheduler(default_model, async_scheduling)
    from quantserve.modeling import chat_prompt

    chat = lambda q: tok.encode(chat_prompt(tok, q))  # noqa: E731  (answers of a few tokens, then end-of-text)
    streams = {"a": recording_stream(chat("Sort: c b a"), 40, ignore_eos=False),
               "b": recording_stream(tok.encode("Reverse: x y z w"), 90),
               "c": recording_stream(chat("Repeat: p q r s"), 60, ignore_eos=False),
               "d": recording_stream(tok.encode("Repeat: x y z"), 200),
               "e": recording_stream(tok.encode("Count the letters: a b c d e f"), 25)}
    try:
        for label in "abc":
            sched.submit([streams[label]])
        deadline = time.monotonic() + 60
        while len(streams["b"].tokens) < 10:  # b decodes on through d's prompt and e's
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sched.submit([streams["d"]])
        while len(streams["d"].tokens) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sched.cancel(streams["d"].request.request_id)
        sched.submit([streams["e"]])
        for s in streams.values():
            assert s.done.wait(60)
    finally:
        sched.shutdown(5)
    assert backend.pool.used_blocks() == 0
    return {k: (s.tokens, s.finish) for k, s in streams.items()}, len(launches)


def test_steps_launched_ahead_give_the_tokens_of_steps_one_at_a_time(default_model):
    ahead, launched = _busy_run(default_model, True)
    plain, none = _busy_run(default_model, False)
    assert launched > 20 and none == 0  # the pipelined path ran (and only when asked)
    for label in "abce":
        assert ahead[label] == plain[label], label
    assert ahead["a"][1] == "stop" and 1 < len(ahead["a"][0]) < 40  # ended on end-of-text mid-stream
    assert ahead["b"][1] == "length" and len(ahead["b"][0]) == 90
    assert ahead["d"][1] == "cancelled" and plain["d"][1] == "cancelled"


def test_steps_launched_ahead_survive_preemption(default_model):
    """A pool of 8 blocks (128 tokens) for three requests that grow to ~80 tokens each: sequences
    are preempted and computed again between pipelined steps, and every answer is the same."""
    answers = {}
    for async_scheduling in (True, False):
        sched, backend, tok, launches = _scheduler(default_model, async_scheduling, kv_blocks=8)
        streams = [recording_stream(tok.encode(t), 70) for t in ("Sort: c b a", "Reverse: x y z w", "Repeat: p q r s")]
        try:
            for s in streams:
                sched.submit([s])
            for s in streams:
                assert s.done.wait(120)
            stats = sched._kv_stats()
        finally:
            sched.shutdown(5)
        assert stats["preemptions"] > 0 and backend.pool.used_blocks() == 0
        assert all(len(s.tokens) == 70 for s in streams)
        answers[async_scheduling] = ([s.tokens for s in streams], len(launches))
    assert answers[True][0] == answers[False][0] and answers[True][1] > 0


def test_sampled_requests_take_the_ordinary_step(default_model):
    """Only plain greedy batches run ahead: a sampled request (its own generator, on the host)
    makes the batch it is in take steps one at a time."""
    from quantserve.modeling import load_tokenizer
    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.fastcore.adapter import FastCoreBackend
    from quantserve.server.paged_scheduler import PagedScheduler
    from quantserve.server.sampling import SamplingParams

    tok = load_tokenizer(default_model)
    backend = FastCoreBackend(default_model, max_batch=2, context_length=512)
    sched = PagedScheduler(backend, set(tok.all_special_ids), max_batch=2, max_queue=4)
    backend.launch_greedy = lambda *a: pytest.fail("a sampled batch was launched ahead")
    done = threading.Event()

    class Stream(TokenStream):
        def deliver(self, event) -> None:
            if event.finish_reason:
                done.set()

    params = SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True)
    try:
        sched.submit([Stream(EngineRequest(tok.encode("Sort: c b a"), params), loop=None, engine=None)])
        assert done.wait(60)
    finally:
        sched.shutdown(5)


def test_an_embedding_is_not_held_back_by_steps_launched_ahead(default_model):
    """An embedding request arriving while a long greedy generation runs ahead is served at once.
    It used to wait for the generation to end: the launcher left embeddings out of its check that
    the batch had changed, so the ordinary step that embeds never ran."""
    from quantserve.server.engine import EngineRequest, TokenStream
    from quantserve.server.sampling import SamplingParams

    sched, backend, tok, launches = _scheduler(default_model, async_scheduling=True)
    decode = recording_stream(tok.encode("Repeat: x y z"), 300)
    embedded = threading.Event()
    tokens_then = []

    class Embedding(TokenStream):
        def deliver(self, event) -> None:
            if event.finish_reason:
                tokens_then.append(len(decode.tokens))
                embedded.set()

    params = SamplingParams(max_tokens=0, temperature=0.0, ignore_eos=True, embed="last")
    try:
        sched.submit([decode])
        deadline = time.monotonic() + 60
        while len(decode.tokens) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        sched.submit([Embedding(EngineRequest(tok.encode("Count the letters: a b c"), params), loop=None, engine=None)])
        assert embedded.wait(60) and decode.done.wait(60)
    finally:
        sched.shutdown(5)
    assert launches, "the generation never ran ahead"
    assert tokens_then[0] < 150, f"the embedding waited for {tokens_then[0]} of the generation's 300 tokens"
    assert backend.pool.used_blocks() == 0
