"""Continuous batching: one thread owns the model and runs the batch one token at a time.

Each iteration, at a token boundary: drop cancelled requests (their slot and KV memory are freed
at once), admit waiting requests into free slots, prefill up to `prefill_chunk` prompt tokens
(oldest prompt first; a prompt that completes samples its first token), then run one batched
decode step for every sequence past its prompt, each sampled with its own parameters.  Finished
sequences leave the batch before the next step, so a request arriving mid-batch starts after at
most one step, and a long prompt is prefilled in chunks between decode steps instead of stalling
the running sequences for its whole length (chunked prefill).

The scheduler is the same for every engine; only the `DecodeBackend` differs.

Failures end only the requests they touch, with an `EngineError` the API turns into an error reply:
a failed prefill or sampling step fails that request; a failed decode step fails the batch, except
when memory ran out: then the sequence holding the most KV cache is failed (503 out_of_memory) and
the step is retried without it, so one oversized request does not take the others down with it.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

from quantserve.server.backend import DecodeBackend
from quantserve.server.config import EngineOptions
from quantserve.server.engine import (EngineClosedError, EngineError, EngineStats, OutOfMemoryError, QueueFullError,
                           TokenEvent, TokenStream, TopLogprob)
from quantserve.server.exceptions import OutputFormatError
from quantserve.server.running import RunningSequence
from quantserve.server.sampling import SequenceSampler, masked_argmax


def _on_host(logits):
    """A logits row where the CPU sampler reads it: a torch tensor copied to the host, numpy as it is."""
    return logits.cpu() if hasattr(logits, "cpu") else logits


class Scheduler:
    def __init__(self, backend: DecodeBackend, eos_token_ids: set[int], max_batch: int, max_queue: int,
                 log=None, prefill_chunk: int | None = None):
        self.backend = backend
        self.eos_token_ids = set(eos_token_ids)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk or EngineOptions().chunk()  # prompt tokens per iteration, all prompts
        self._log = log or (lambda msg: None)
        self._cond = threading.Condition()
        self._waiting: collections.deque[tuple[TokenStream, float]] = collections.deque()
        self._preempted: list[RunningSequence] = []  # sequences sent back to wait (paged_scheduler.py), admitted first
        self._arrivals = itertools.count()
        self._running: dict[int, RunningSequence] = {}  # request id -> state
        self._cancelled: set[int] = set()
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._closing = False
        self._generated_tokens = 0
        self._cancelled_count = 0
        self._decode_steps = 0
        self._decode_rows = 0
        self._deadline: float | None = None
        self._outbox: list[tuple[TokenStream, TokenEvent]] = []  # events not yet handed to the event loop
        self._thread = threading.Thread(target=self._loop, name="quantserve-scheduler", daemon=True)
        self._thread.start()

    # ---- called from the event loop -------------------------------------------------------------

    def submit(self, streams: list[TokenStream]) -> None:
        """Queue one request's sequences (its choices or inputs) together, or none of them.  The
        queue is full when `max_queue` sequences wait as the request arrives; a request that finds
        room brings all its sequences in, so one with more choices than `max_queue` still runs on
        an idle server (the API caps a request's sequences: serving.py).  What waits for a free slot
        does not count: a burst of requests on an idle server fills the batch before the loop has
        had a turn to admit them."""
        with self._cond:
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            if len(self._waiting) - len(self._free_slots) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting, "
                                     f"{len(self._running)} running)")
            now = time.perf_counter()
            self._waiting.extend((stream, now) for stream in streams)
            self._cond.notify()

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify()

    def stats(self) -> EngineStats:
        with self._cond:
            running, waiting = len(self._running), len(self._waiting) + len(self._preempted)
        queried, hits = self.backend.prefix_cache_stats()
        return EngineStats(running=running, waiting=waiting, kv_used_tokens=self.backend.cached_tokens(),
                           kv_capacity_tokens=self.backend.kv_capacity_tokens,
                           generated_tokens=self._generated_tokens, cancelled=self._cancelled_count,
                           decode_steps=self._decode_steps, decode_rows=self._decode_rows,
                           prefix_queried_tokens=queried, prefix_hit_tokens=hits, **self._kv_stats())

    def _kv_stats(self) -> dict:
        """Paged backends add their block use and preemptions (paged_scheduler.py)."""
        return {}

    def shutdown(self, grace_s: float) -> None:
        """Stop admitting; let queued and running work finish for `grace_s`, then cancel the rest."""
        with self._cond:
            self._closing = True
            self._deadline = time.perf_counter() + grace_s
            self._cond.notify()
        self._thread.join(grace_s + 30)

    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the scheduler thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as e:  # a bug here must fail the requests, not hang them forever
                self._log(f"scheduler error: {type(e).__name__}: {e}")
                error = EngineError.from_exception(e)
                with self._cond:
                    for seq in list(self._running.values()):
                        self._fail(seq, error)
            finally:
                self._flush()

    def _send(self, stream: TokenStream, event: TokenEvent) -> None:
        self._outbox.append((stream, event))

    def _flush(self) -> None:
        """Hand the events gathered since the last flush to the event loop in one wake-up."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            undelivered = TokenStream.push_all(events)
            if undelivered:
                self._log(f"could not deliver {undelivered} events: their event loop is closed")

    def _iteration(self) -> bool:
        """One round: cancellations, admissions, then the model's work (`_step`).  True when shut down."""
        with self._cond:
            while not (self._running or self._waiting or self._preempted or self._closing):
                self._cond.wait()
            self._drop_cancelled()
            if self._closing and self._deadline is not None and time.perf_counter() >= self._deadline:
                self._cancel_everything()
            if self._closing and not (self._running or self._waiting or self._preempted):
                return True
            resumed = []
            while self._preempted and self._free_slots and self._may_resume(self._preempted[0]):
                resumed.append((self._preempted.pop(0), self._free_slots.pop()))
            admitted = []
            while self._waiting and self._free_slots and not self._preempted:
                admitted.append((*self._waiting.popleft(), self._free_slots.pop()))
        for seq, slot in resumed:
            self._start(seq, slot)
        for stream, submitted_at, slot in admitted:
            self._admit(stream, submitted_at, slot)
        self._step()
        return False

    def _may_resume(self, seq: RunningSequence) -> bool:
        return True

    def _step(self) -> None:
        """A prefill chunk, then one decode step (a paged backend does both in one forward: paged_scheduler.py)."""
        self._prefill_chunk()
        self._flush()  # first tokens go out now, not after the decode step
        if any(seq.decoding for seq in self._running.values()):
            self._decode_step()

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for stream, t in list(self._waiting):
            if stream.request.request_id in self._cancelled:
                self._waiting.remove((stream, t))
                self._cancelled_count += 1
                self._send(stream, TokenEvent(None, finish_reason="cancelled"))
        for rid in list(self._running):
            if rid in self._cancelled:
                self._finish(self._running[rid], TokenEvent(None, finish_reason="cancelled"))
        for seq in [s for s in self._preempted if s.stream.request.request_id in self._cancelled]:
            self._preempted.remove(seq)
            self._cancelled_count += 1
            self._send(seq.stream, TokenEvent(None, finish_reason="cancelled"))
        self._cancelled.clear()

    def _cancel_everything(self) -> None:
        for stream, _ in self._waiting:
            self._send(stream, TokenEvent(None, finish_reason="cancelled"))
        self._waiting.clear()
        for seq in self._preempted:
            self._send(seq.stream, TokenEvent(None, finish_reason="cancelled"))
        self._preempted.clear()
        for seq in list(self._running.values()):
            self._finish(seq, TokenEvent(None, finish_reason="cancelled"))

    def _finish(self, seq: RunningSequence, event: TokenEvent) -> None:
        """Remove a sequence from the batch, free its KV memory, and end its stream."""
        self._running.pop(seq.stream.request.request_id, None)
        self.backend.free(seq.slot)
        with self._cond:
            self._free_slots.append(seq.slot)
        if event.finish_reason == "cancelled":
            self._cancelled_count += 1
        event.elapsed_s = time.perf_counter() - seq.submitted_at
        self._send(seq.stream, event)

    def _fail(self, seq: RunningSequence, error: EngineError) -> None:
        self._finish(seq, TokenEvent(None, finish_reason="error", error=error))

    @staticmethod
    def _kv_tokens(seq: RunningSequence) -> int:
        return seq.prefilled

    def _admit(self, stream: TokenStream, submitted_at: float, slot: int) -> None:
        req = stream.request
        seq = RunningSequence(stream, slot, SequenceSampler(req.params, req.prompt_ids, self.backend.vocab_size),
                       last_token=-1, generated=0, submitted_at=submitted_at, admitted_at=time.perf_counter(),
                       arrival=next(self._arrivals))
        self._start(seq, slot)
        seq.cached = seq.prefilled

    def _start(self, seq: RunningSequence, slot: int) -> None:
        """`seq` (new, or resumed after preemption) runs in `slot`, from the longest cached prefix
        of its context."""
        req = seq.stream.request
        seq.slot = slot
        self._running[req.request_id] = seq
        if seq.scoring:
            seq.prompt_scores = [(req.prompt_ids[0], None, [])]  # the first token has no context
        fresh = seq.scoring or req.params.embed is not None  # every position computed, nothing reused
        try:
            seq.prefilled = self.backend.start(slot, [] if fresh else seq.context())
        except Exception as e:
            self._log(f"starting request {req.request_id} failed: {type(e).__name__}: {e}")
            self._fail(seq, EngineError.from_exception(e))

    def _prefill_chunk(self) -> None:
        """Prefill up to `prefill_chunk` prompt tokens, oldest admitted prompt first.  A prompt that
        does not fit in what is left of the budget waits for the next iteration instead of being
        cut there: each piece is a forward of its own, a whole pass over the weights.  (A paged
        backend runs every piece and decode in one forward instead: paged_scheduler.py.)"""
        for seq in [s for s in self._running.values() if s.stream.request.params.embed is not None]:
            self._embed(seq)
        budget, pieces = self.prefill_chunk, []
        for seq in [s for s in self._running.values() if not s.decoding]:  # dicts keep admission order
            prompt = seq.stream.request.prompt_ids
            # a request admitted with others that share its prefix finds it here once one of them
            # has prefilled it (the first of 32 clients with one system prompt computes it for all)
            try:
                have = seq.prefilled if seq.scoring else self.backend.reuse(seq.slot, prompt, seq.prefilled)
            except Exception as e:
                self._log(f"prefix reuse for request {seq.stream.request.request_id} failed: {type(e).__name__}: {e}")
                self._fail(seq, EngineError.from_exception(e))
                continue
            seq.cached += have - seq.prefilled
            seq.prefilled = have
            if budget <= 0 or (len(prompt) - seq.prefilled > budget and budget < self.prefill_chunk):
                break
            chunk = prompt[seq.prefilled:seq.prefilled + budget]
            pieces.append((seq, chunk))
            budget -= len(chunk)
        for seq, chunk in pieces:
            try:
                if seq.scoring:
                    logits = self._scored_prefill(seq, chunk)
                else:
                    logits = self.backend.prefill(seq.slot, chunk, seq.prefilled)
            except Exception as e:  # a failed prompt must not take the server down
                self._log(f"prefill of request {seq.stream.request.request_id} "
                          f"({len(seq.stream.request.prompt_ids)} tokens) failed: {type(e).__name__}: {e}")
                self._fail(seq, EngineError.from_exception(e))
                continue
            self._prefilled(seq, chunk, logits)

    def _embed(self, seq: RunningSequence) -> None:
        """An embedding request: one forward over its whole input, its pooled hidden state as the
        only event (it never joins the decode batch)."""
        req = seq.stream.request
        try:
            vector = self.backend.embed(seq.slot, req.prompt_ids, req.params.embed)
        except Exception as e:
            self._log(f"embedding of request {req.request_id} ({len(req.prompt_ids)} tokens) failed: "
                      f"{type(e).__name__}: {e}")
            self._fail(seq, EngineError.from_exception(e))
            return
        seq.prefilled = len(req.prompt_ids)
        self._finish(seq, TokenEvent(None, finish_reason="stop", embedding=[float(x) for x in vector]))

    def _scored_prefill(self, seq: RunningSequence, chunk: list[int]):
        """Prefill with every position's logits; score the prompt tokens they predict.  Returns
        the last position's logits (the next token's)."""
        from quantserve.server.sampling import score_tokens

        prompt, start = seq.stream.request.prompt_ids, seq.prefilled
        rows = self.backend.prefill(seq.slot, chunk, start, all_logits=True)
        targets = prompt[start + 1:start + len(chunk) + 1]  # row i predicts the token after position i
        k = seq.stream.request.params.prompt_logprobs
        for token, (logprob, top) in zip(targets, score_tokens(rows[:len(targets)], targets, k)):
            seq.prompt_scores.append((token, logprob, [TopLogprob(t, lp) for t, lp in top]))
        return rows[-1]

    def _prefilled(self, seq: RunningSequence, chunk: list[int], logits, token: int | None = None) -> None:
        """`chunk` of `seq`'s context is in the cache; `logits` are its last position's (a greedy
        sequence may come with its `token` already picked from them)."""
        seq.prefilled += len(chunk)
        if not seq.ready or seq.generated:  # more to come, or a resumed sequence: its next token is known
            return
        if seq.stream.request.params.max_tokens == 0:  # scoring only (echo): the prompt is the reply
            self._finish(seq, TokenEvent(None, finish_reason="length", cached_tokens=seq.cached,
                                         prompt_logprobs=seq.prompt_scores))
        elif token is not None:
            self._emit(seq, None, token)  # the prompt is in: its first token (which carries `cached`)
        else:
            self._emit(seq, _on_host(logits))

    def _decode_step(self) -> None:
        batch = [seq for seq in self._running.values() if seq.decoding]
        while True:
            try:
                logits = self.backend.decode([s.slot for s in batch], [s.last_token for s in batch])
                break
            except Exception as e:
                self._log(f"decode step of {len(batch)} sequences failed: {type(e).__name__}: {e}")
                error = EngineError.from_exception(e)
            # (outside the except clause: the traceback, which holds the failed step's tensors, is gone)
            if not isinstance(error, OutOfMemoryError) or len(batch) == 1:
                for seq in batch:
                    self._fail(seq, error)
                return
            # the step's memory grows with the longest cache: shed that sequence, retry the others
            victim = max(batch, key=self._kv_tokens)
            self._log(f"shedding request {victim.stream.request.request_id} ({self._kv_tokens(victim)} "
                      "tokens in KV cache) to free memory")
            batch.remove(victim)
            self._fail(victim, error)
        self._decoded(batch, logits)

    def _decoded(self, batch: list[RunningSequence], logits, argmax: list[int] | None = None) -> None:
        """A decode step fed each sequence of `batch` its last token: sample the next ones from
        `logits` (a row per sequence, in order; `argmax`: their greedy picks, when taken already)."""
        self._decode_steps += 1
        self._decode_rows += len(batch)
        for seq in batch:
            seq.prefilled += 1
        # Plain greedy rows take one batched argmax where the logits are (on a GPU: a copy of
        # `batch` ints instead of batch x vocab floats, 16 MB a step at 32 x 128k); the rest are
        # sampled on the CPU, each with its own generator, penalties and logprobs.
        if argmax is None and any(seq.sampler.plain_greedy for seq in batch):
            argmax = logits.argmax(-1).tolist()
        # Greedy rows under a grammar (structured output) take one masked argmax the same way.
        masked = self._masked_argmax(logits, batch)
        for row, seq in enumerate(batch):
            if seq.sampler.plain_greedy:
                self._emit(seq, None, argmax[row])
            elif row in masked:
                self._emit(seq, None, masked[row])
            else:
                self._emit(seq, _on_host(logits[row]))

    def _masked_argmax(self, logits, batch: list[RunningSequence]) -> dict[int, int]:
        """row -> token for the batch's masked-greedy rows (all their masks computed at once)."""
        rows = [row for row, seq in enumerate(batch) if seq.sampler.masked_greedy]
        if not rows:
            return {}
        from quantserve.server.structured import batch_bitmasks

        masks = batch_bitmasks([batch[row].stream.request.params.constraint for row in rows])
        return dict(zip(rows, masked_argmax(logits, rows, masks)))

    def _emit(self, seq: RunningSequence, logits, token: int | None = None) -> None:
        try:
            self._sample_and_send(seq, logits, token)
        except Exception as e:  # e.g. sampling from non-finite logits: only this request fails
            if not isinstance(e, OutputFormatError):  # the request's own fault, answered as a 400: no server error
                self._log(f"sampling failed: {type(e).__name__}: {e}")
            self._fail(seq, EngineError.from_exception(e))

    def _sample_and_send(self, seq: RunningSequence, logits, token: int | None = None) -> None:
        """Sample one token for `seq` (or take the one already picked), send it, and retire the
        sequence if it is done."""
        params = seq.stream.request.params
        if token is None:
            token, logprob, top = seq.sampler.sample(logits)
        else:
            seq.sampler.accept(token)
            logprob, top = None, None
        seq.generated += 1
        self._generated_tokens += 1
        seq.last_token = token
        seq.output_ids.append(token)
        event = TokenEvent(token, logprob, [TopLogprob(t, lp) for t, lp in top] if top is not None else None)
        if seq.generated == 1:
            event.cached_tokens, event.prompt_logprobs = seq.cached, seq.prompt_scores
            event.queued_s = seq.admitted_at - seq.submitted_at
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            event.finish_reason = "stop"
        elif seq.generated >= params.max_tokens:
            event.finish_reason = "length"
        if event.finish_reason:
            self._finish(seq, event)
        else:
            event.elapsed_s = time.perf_counter() - seq.submitted_at
            self._send(seq.stream, event)
