"""Requests that arrive together with one shared prefix (32 clients, one system prompt): the
paged scheduler computes the prefix once, in the oldest request's piece, and the others take it
from the cache a step later instead of computing it again in the same forward, and, when the prefix
takes several steps, trail the first request block by block.  The answers stay those of a scheduler without the prefix cache.  On the CPU the fast engine runs
eagerly, the same code."""

from __future__ import annotations

from tests.support.streams import recording_stream

SHARED = ("You are a careful assistant. Answer in one short line, without any preamble. "
          "Sort letters, reverse words and count items exactly as asked. ") * 2
QUESTIONS = ["Sort: c b a", "Reverse: x y z w", "Repeat: p q r s", "Count the letters: a b c"]


def _run_together(sched, streams) -> None:
    """Every stream waiting before the scheduler's first iteration (its lock is reentrant), then
    each one run to its end, and the scheduler shut down."""
    try:
        with sched._cond:
            for s in streams:
                sched.submit([s])
        for s in streams:
            assert s.done.wait(60)
    finally:
        sched.shutdown(5)


def _together(default_model, prefix_cache: bool, budget: int):
    """The four questions after SHARED, submitted in one go -> (tokens per request, prompt tokens
    the forwards computed, the pool's hit tokens)."""
    from quantserve.modeling import load_tokenizer
    from quantserve.server.fastcore.adapter import FastCoreBackend
    from quantserve.server.paged_scheduler import PagedScheduler

    tok = load_tokenizer(default_model)
    backend = FastCoreBackend(default_model, max_batch=4, context_length=512, prefix_cache=prefix_cache)
    computed = []
    real = backend.step
    backend.step = lambda items: computed.extend(len(ids) for _, ids in items if len(ids) > 1) or real(items)
    sched = PagedScheduler(backend, set(tok.all_special_ids), max_batch=4, max_queue=8,
                           max_batched_tokens=budget, async_scheduling=False)
    streams = [recording_stream(tok.encode(SHARED + q), 6) for q in QUESTIONS]
    _run_together(sched, streams)
    assert backend.pool.used_blocks() == 0
    return [s.tokens for s in streams], sum(computed), backend.pool.hit_tokens, len(streams[0].request.prompt_ids)


def test_a_prefix_shared_by_requests_arriving_together_is_computed_once(default_model):
    cold, cold_computed, _, _ = _together(default_model, prefix_cache=False, budget=512)
    tokens, computed, hits, prompt_len = _together(default_model, prefix_cache=True, budget=512)
    assert tokens == cold
    shared_blocks = (prompt_len - 12) // 16  # the prompts differ in their last ~12 tokens at most
    # the three later requests take every whole block of the shared text from the cache
    assert hits >= 3 * shared_blocks * 16, (hits, shared_blocks)
    assert computed <= cold_computed - 3 * shared_blocks * 16


def test_requests_trail_a_prefix_that_takes_several_steps(default_model):
    """A budget of 100 tokens for prompts of ~170: the first request's prefix takes two steps; the
    others wait for each step's blocks instead of computing from where the cache ended (the second
    took 6 blocks after the first step and computed the rest itself)."""
    cold, _, _, _ = _together(default_model, prefix_cache=False, budget=100)
    tokens, computed, hits, prompt_len = _together(default_model, prefix_cache=True, budget=100)
    assert tokens == cold
    shared_blocks = (prompt_len - 12) // 16
    assert hits >= 3 * shared_blocks * 16, (hits, shared_blocks)


def test_identical_prompts_of_whole_blocks_start_together(default_model):
    """Eight copies of one 64-token prompt (4 whole blocks; n > 1 or clients repeating a prompt).
    A sequence always computes the block holding its last token itself, so waiting for another
    sequence to compute that block gains nothing: the copies take the first 3 blocks from the
    cache in the second forward and all start there.  They used to start one forward apart."""
    from quantserve.server.fastcore.adapter import FastCoreBackend
    from quantserve.server.paged_scheduler import PagedScheduler

    backend = FastCoreBackend(default_model, max_batch=8, context_length=512)
    forwards = []
    real = backend.step
    backend.step = lambda items: forwards.append(len(items)) or real(items)
    sched = PagedScheduler(backend, set(), max_batch=8, max_queue=16, max_batched_tokens=512,
                           async_scheduling=False)
    prompt = [(11 * i) % 700 + 3 for i in range(64)]
    streams = [recording_stream(prompt, 4) for _ in range(8)]
    started = {}
    for i, s in enumerate(streams):  # the forwards run before each one's first token
        deliver = s.deliver
        s.deliver = lambda event, i=i, deliver=deliver: (started.setdefault(i, len(forwards)), deliver(event))
    _run_together(sched, streams)
    assert [started[i] for i in range(8)] == [1] + [2] * 7, started
    assert all(s.tokens == streams[0].tokens for s in streams)
    assert backend.pool.hit_tokens == 7 * 48
    assert backend.pool.used_blocks() == 0
