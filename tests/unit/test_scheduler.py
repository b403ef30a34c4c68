"""The scheduler alone, driven by a fake backend (no model): the shape of vLLM's
tests/v1/core/test_scheduler.py.  The fake's "model" continues every sequence with last token + 1,
so every right answer is known without running anything."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from quantserve.server.engine import EngineRequest, QueueFullError, TokenStream
from quantserve.server.sampling import SamplingParams
from quantserve.server.scheduler import Scheduler

VOCAB, EOS = 64, 63


class CountingBackend:
    """next token = last token + 1; records what the scheduler asked of it."""

    def __init__(self, max_batch: int):
        self.vocab_size, self.kv_capacity_tokens = VOCAB, max_batch * 128
        self.last: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.decode_batches: list[int] = []
        self.freed: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def _logits(self, last: int) -> np.ndarray:
        row = np.zeros(VOCAB, dtype=np.float32)
        row[(last + 1) % VOCAB] = 10.0
        return row

    def start(self, slot, prompt_ids):
        return 0  # no prefix cache

    def reuse(self, slot, prompt_ids, have):
        return have

    def prefix_cache_stats(self):
        return 0, 0

    def prefill(self, slot, prompt_ids, start=0):
        self.last[slot] = prompt_ids[-1]
        self.lengths[slot] = start + len(prompt_ids)
        return self._logits(prompt_ids[-1])

    def decode(self, slots, tokens):
        self.gate.wait(10)
        self.decode_batches.append(len(slots))
        for s, t in zip(slots, tokens):
            self.last[s], self.lengths[s] = t, self.lengths[s] + 1
        return np.stack([self._logits(t) for t in tokens])

    def free(self, slot):
        self.freed.append(slot)
        self.last.pop(slot, None)
        self.lengths.pop(slot, None)

    def cached_tokens(self):
        return sum(self.lengths.values())


class Collect(TokenStream):
    def __init__(self, prompt, max_tokens, ignore_eos=True):
        super().__init__(EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                              ignore_eos=ignore_eos)), loop=None, engine=None)
        self.tokens, self.finish, self.done = [], None, threading.Event()

    def deliver(self, event):  # on the scheduler thread (no event loop in this test)
        if event.token_id is not None:
            self.tokens.append(event.token_id)
        if event.finish_reason:
            self.finish = event.finish_reason
            self.done.set()


@pytest.fixture
def sched():
    backend = CountingBackend(max_batch=4)
    s = Scheduler(backend, {EOS}, max_batch=4, max_queue=8, prefill_chunk=16)
    yield s
    backend.gate.set()
    s.shutdown(5)


def test_every_request_gets_its_own_greedy_continuation(sched):
    streams = [Collect([i, i + 1], max_tokens=5 + i) for i in range(6)]  # 6 > max_batch: some wait
    for st in streams:
        sched.submit([st])
    for i, st in enumerate(streams):
        assert st.done.wait(10)
        assert st.tokens == [(i + 2 + k) % VOCAB for k in range(5 + i)] and st.finish == "length"
    assert max(sched.backend.decode_batches) <= 4  # never more running than max_batch
    assert sched.backend.cached_tokens() == 0
    assert len(sched.backend.freed) == 6  # every slot handed back


def test_eos_ends_a_sequence_with_stop(sched):
    st = Collect([EOS - 3], max_tokens=50, ignore_eos=False)
    sched.submit([st])
    assert st.done.wait(10)
    assert st.tokens == [EOS - 2, EOS - 1, EOS] and st.finish == "stop"


def test_a_full_queue_refuses_at_submit_time(sched):
    sched.backend.gate.clear()  # hold decode: running sequences stay, the queue fills
    running = [Collect([1], max_tokens=100) for _ in range(4)]
    for st in running:
        sched.submit([st])
    while sched.stats().running < 4:
        threading.Event().wait(0.01)
    waiting = [Collect([1], max_tokens=1) for _ in range(8)]
    for st in waiting:
        sched.submit([st])
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.submit([Collect([1], max_tokens=1)])
    for st in running:
        sched.cancel(st.request.request_id)
    sched.backend.gate.set()
    assert all(st.done.wait(10) for st in running + waiting)
    assert {st.finish for st in running} == {"cancelled"} and {st.finish for st in waiting} == {"length"}


def test_a_burst_on_an_idle_scheduler_fills_the_batch_and_the_queue(sched):
    """max_batch + max_queue requests at once are all taken, even before the loop has admitted any
    (it waits on the lock held here): the queue is what waits beyond the free slots."""
    sched.backend.gate.clear()
    burst = [Collect([1], max_tokens=3) for _ in range(sched.max_batch + sched.max_queue)]
    with sched._cond:  # the loop admits under this lock: none of the burst is admitted yet
        for st in burst:
            sched.submit([st])
        with pytest.raises(QueueFullError, match="queue is full"):
            sched.submit([Collect([1], max_tokens=1)])
    sched.backend.gate.set()
    assert all(st.done.wait(10) for st in burst) and {st.finish for st in burst} == {"length"}


def test_a_cancelled_request_frees_its_slot_for_the_next(sched):
    # decode held until the cancel is in: the fake backend is instant, and on a loaded machine the
    # request once ran into its context limit ("length") before this thread got to cancel it
    sched.backend.gate.clear()
    long = Collect([1], max_tokens=10_000)
    sched.submit([long])
    while not long.tokens:
        threading.Event().wait(0.005)
    sched.cancel(long.request.request_id)
    sched.backend.gate.set()
    assert long.done.wait(10) and long.finish == "cancelled"
    after = Collect([5], max_tokens=3)
    sched.submit([after])
    assert after.done.wait(10) and after.tokens == [6, 7, 8]
    assert sched.backend.cached_tokens() == 0


def test_one_request_brings_all_its_sequences_in_or_none(sched):
    """A request's choices enter together: more of them than the queue holds still run on an idle
    scheduler (the queue counts what waits as a request arrives), and a full queue refuses a request
    without keeping any of its sequences."""
    many = [Collect([i], max_tokens=2) for i in range(sched.max_queue + 5)]
    sched.submit(many)
    assert all(st.done.wait(10) for st in many) and {st.finish for st in many} == {"length"}
    sched.backend.gate.clear()
    held = [Collect([1], max_tokens=100) for _ in range(sched.max_batch + sched.max_queue)]
    sched.submit(held)
    refused = [Collect([1], max_tokens=1) for _ in range(3)]
    with pytest.raises(QueueFullError):
        sched.submit(refused)
    assert sched.stats().waiting + sched.stats().running == len(held)
    for st in held:
        sched.cancel(st.request.request_id)
    sched.backend.gate.set()
    assert all(st.done.wait(10) for st in held) and not any(st.done.is_set() for st in refused)
