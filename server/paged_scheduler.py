"""The scheduler of a paged backend (the fast engine): one forward per iteration, under a token
budget, over a KV pool that can run out.

Each iteration, oldest sequence first (vLLM's v1 scheduler, SGLang and llama.cpp's server work
this way), every running sequence takes what it needs next: a decoding one its one token, a
prompt the next chunk of what is left, until the budget (`max_num_batched_tokens`) is spent.  All
of it runs as one flattened batch (fastcore/batch.py): one pass over the weights for every decode
and every prompt chunk together, instead of a forward per prompt and another for the decodes.

KV memory is taken block by block as sequences grow (fastcore/blocks.py).  When a sequence needs
a block and none is free, the newest running sequence is preempted: its blocks go back to the
pool (its full ones stay cached), it waits at the head of the queue, and when it resumes its
context (prompt and tokens so far) is computed again, mostly found in the prefix cache.  Nobody
fails for want of memory, and the oldest request always progresses.  A request that could not
fit the whole pool alone is refused before it is queued (serving.py).

Requests that arrive together with one prefix (a system prompt) do not all compute it: a prompt
whose next block an older sequence's piece completes in this iteration waits one iteration and
takes that block from the cache (SGLang's in-batch prefix caching).

Decode steps run one ahead of the host ("async scheduling", as vLLM's and SGLang's overlap
schedulers do): while every running sequence is decoding greedily with nothing else to compute,
step k + 1 is launched, fed step k's tokens on the GPU, before the host reads step k's tokens;
the host then emits step k's tokens (detokenizing, stop checks, the event loop's streaming) while
the GPU computes step k + 1.  Without it the GPU waited on that host work every step (a 1B model's
0.95 ms step took 1.3 ms a token in the server).  A sequence that ends on a stop token at step k
had step k + 1 computed for nothing; one that ends on length never gets it.  Anything else (a
prompt chunk, a new request, sampling, structured output, logprobs) first reads the step in flight
and runs the ordinary way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from quantserve.server.config import EngineOptions
from quantserve.server.engine import EngineError, OutOfMemoryError
from quantserve.server.prefix_cache import BLOCK
from quantserve.server.running import RunningSequence
from quantserve.server.scheduler import Scheduler

log = logging.getLogger("quantserve.server")


@dataclass
class _InFlight:
    """A decode step launched and not read yet: each sequence of `batch` fed at `positions`."""
    batch: list[RunningSequence]
    positions: list[int]
    picks: object  # the step's greedy tokens on the device (the next step's input)
    pending: object  # the same, on their way to the host (fastcore.core.PendingTokens)


class PagedScheduler(Scheduler):
    def __init__(self, backend, eos_token_ids: set[int], max_batch: int, max_queue: int, log=None,
                 max_batched_tokens: int | None = None, async_scheduling: bool = True):
        max_batched_tokens = max_batched_tokens or EngineOptions().batched_tokens()
        if max_batched_tokens < max_batch:
            raise ValueError(f"max_num_batched_tokens ({max_batched_tokens}) must hold a token for each of "
                             f"max_batch ({max_batch}) running sequences")
        self.pool = backend.pool
        self.max_batched_tokens = max_batched_tokens
        self._preemptions = 0
        self.async_scheduling = async_scheduling and hasattr(backend, "launch_greedy")
        self._in_flight: _InFlight | None = None
        super().__init__(backend, eos_token_ids, max_batch, max_queue, log)

    def _kv_stats(self) -> dict:
        return {"kv_blocks_used": self.pool.used_blocks(), "kv_blocks_total": self.pool.num_blocks,
                "preemptions": self._preemptions}

    def _may_resume(self, seq: RunningSequence) -> bool:
        """A preempted sequence comes back once its whole context and a token more would fit."""
        return self.pool.free_blocks() >= self.pool.blocks_for(seq.context_len() + 1)

    # ---- one iteration -------------------------------------------------------------------------
    def _step(self) -> None:
        if self._in_flight is not None and self._launch_next():
            return
        self._read_in_flight()
        for seq in [s for s in self._running.values() if s.stream.request.params.embed is not None]:
            if self.pool.free_blocks() >= self.pool.blocks_for(len(seq.stream.request.prompt_ids)):
                self._embed(seq)  # its whole input at once; otherwise it waits for blocks
        decodes, pieces = self._plan()
        scored = [(seq, chunk) for seq, chunk in pieces if seq.scoring]
        pieces = [(seq, chunk) for seq, chunk in pieces if not seq.scoring]
        for seq, chunk in scored:  # every position's logits: a forward of their own (eager)
            self._run_piece(seq, chunk)
        if decodes and not pieces and self._may_run_ahead(decodes, 0) and \
                self._launch(decodes, [s.prefilled for s in decodes], [s.last_token for s in decodes]):
            return  # read in the next iteration, after the step after it is launched
        if decodes or pieces:
            self._forward(decodes, pieces)

    # ---- decode steps one ahead of the host ----------------------------------------------------
    def _may_run_ahead(self, batch: list[RunningSequence], unread: int) -> bool:
        """Every sequence greedy with nothing else to compute, and still running once the `unread`
        steps launched for it are read (so the step to launch is not one past its last token)."""
        return self.async_scheduling and all(
            s.sampler.plain_greedy and s.generated + unread < s.stream.request.params.max_tokens for s in batch)

    def _launch(self, batch: list[RunningSequence], positions: list[int], tokens) -> bool:
        try:
            picks, pending = self.backend.launch_greedy([s.slot for s in batch], positions, tokens)
        except Exception as e:  # the ordinary step reports it (and sheds a request if memory ran out)
            self._log(f"a decode step could not be launched ahead ({type(e).__name__}: {e}); running it in step")
            return False
        self._in_flight = _InFlight(batch, positions, picks, pending)
        return True

    def _launch_next(self) -> bool:
        """Step k + 1 for the batch of the step in flight, fed its tokens on the device; then read
        step k.  False (nothing done) when the batch must change first."""
        step = self._in_flight
        if len(self._running) != len(step.batch) or any(self._running.get(s.stream.request.request_id) is not s
                                                        for s in step.batch):
            return False  # a sequence ended or was cancelled, or a new one (an embedding too) was admitted
        with self._cond:
            if (self._waiting and self._free_slots) or self._preempted:
                return False  # someone can start: the next step carries their prompt
        if not self._may_run_ahead(step.batch, 1):
            return False
        positions = [p + 1 for p in step.positions]
        need = sum(max(0, self.pool.blocks_for(p + 1) - len(self.pool.table[s.slot]))
                   for s, p in zip(step.batch, positions))
        if need > self.pool.free_blocks():
            return False  # the ordinary step preempts someone first
        if not self._launch(step.batch, positions, step.picks):
            return False
        self._read(step)
        return True

    def _read_in_flight(self) -> None:
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._read(step)

    def _read(self, step: _InFlight) -> None:
        """A launched step's tokens: recorded in the pool and emitted, for the sequences still running."""
        tokens = step.pending.tolist()
        self._decode_steps += 1
        self._decode_rows += len(step.batch)
        for seq, token in zip(step.batch, tokens):
            if self._running.get(seq.stream.request.request_id) is not seq:
                continue  # ended meanwhile (a stop token one step earlier, cancelled): its slot is not its own
            self.backend.written(seq.slot, [seq.last_token])
            seq.prefilled += 1
            self._emit(seq, None, token)

    def _plan(self) -> tuple[list[RunningSequence], list[tuple[RunningSequence, list[int]]]]:
        """Who takes which tokens in this iteration's forward: (decoding sequences, prompt pieces).
        Blocks are reserved for all of them; the newest sequences are preempted where needed."""
        budget = self.max_batched_tokens
        queue = sorted((s for s in self._running.values() if s.stream.request.params.embed is None),
                       key=lambda s: s.arrival)
        decodes, pieces, i = [], [], 0
        computing: set[int] = set()  # keys of the blocks this step's prompt pieces complete
        while i < len(queue) and budget > 0:
            seq = queue[i]
            keys = None
            context = None if seq.decoding else seq.context()  # one copy for reuse, keys and the piece
            if context is not None and not seq.scoring:
                # more of the prompt may be cached now: a sequence admitted with this one computed it
                have = self.backend.reuse(seq.slot, context, seq.prefilled)
                if seq.generated == 0:
                    seq.cached += have - seq.prefilled
                seq.prefilled = have
                if self.pool.enabled:
                    upto = min(seq.context_len(), seq.prefilled + budget) // BLOCK + 1
                    keys = self.pool.keys(seq.slot, context, upto)
                    if self._computed_by_another(seq, keys, computing):
                        i += 1
                        continue
            want = 1 if seq.decoding else min(seq.context_len() - seq.prefilled, budget)
            while not self.pool.can_grow(seq.slot, seq.prefilled + want):
                room = self.pool.room(seq.slot) - seq.prefilled
                if not seq.decoding and room > 0:
                    want = room  # a prompt takes what fits now, the rest later
                    break
                if queue[-1] is seq:  # nobody newer left to make room
                    want = 0
                    if seq.decoding:
                        self._preempt(queue.pop())
                    break
                self._preempt(queue.pop())
            if want > 0:
                self.pool.reserve(seq.slot, seq.prefilled + want)
                if seq.decoding:
                    decodes.append(seq)
                else:
                    pieces.append((seq, context[seq.prefilled:seq.prefilled + want]))
                    if keys is not None:
                        computing.update(keys[seq.prefilled // BLOCK:(seq.prefilled + want) // BLOCK])
                budget -= want
            i += 1
        return decodes, pieces

    @staticmethod
    def _computed_by_another(seq: RunningSequence, keys: list[int], computing: set[int]) -> bool:
        """Is the block `seq` would compute next being computed in this step by an older sequence's
        piece?  Then `seq` sits this step out and takes that block from the cache in the next one
        (SGLang's in-batch prefix caching).  Otherwise clients arriving at once with one system
        prompt each computed as much of it as the step's budget reached.  Only for a block the cache
        could hand `seq`: never the one holding its last token, which every sequence computes itself
        (BlockPool._match), or identical prompts of whole blocks would start one step apart."""
        block = seq.prefilled // BLOCK
        return seq.prefilled % BLOCK == 0 and block < (seq.context_len() - 1) // BLOCK \
            and block < len(keys) and keys[block] in computing

    def _preempt(self, seq: RunningSequence) -> None:
        """Send `seq` back to wait: its blocks return to the pool (the full ones stay cached).  A
        sequence with nothing in the cache yet (admitted, its prompt not started) loses no work:
        it is put back to wait, not counted or logged as a preemption."""
        if seq.prefilled:
            log.warning("preempting request %s (%d tokens in KV cache) to make room; it resumes when "
                        "blocks free up", seq.stream.request.request_id, seq.prefilled)
            self._preemptions += 1
        self._running.pop(seq.stream.request.request_id, None)
        self.backend.free(seq.slot)
        with self._cond:
            self._free_slots.append(seq.slot)
            self._preempted.append(seq)
            self._preempted.sort(key=lambda s: s.arrival)
        seq.prefilled = 0

    # ---- running it ----------------------------------------------------------------------------
    def _forward(self, decodes: list[RunningSequence], pieces: list[tuple[RunningSequence, list[int]]]) -> None:
        """The decodes and prompt pieces as one forward; then each sequence's next token."""
        while True:
            items = [(s.slot, [s.last_token]) for s in decodes] + [(s.slot, chunk) for s, chunk in pieces]
            try:
                logits = self.backend.step(items)
                break
            except Exception as e:
                self._log(f"a forward of {len(decodes)} decodes and {len(pieces)} prompt pieces failed: "
                          f"{type(e).__name__}: {e}")
                error = EngineError.from_exception(e)
            everyone = decodes + [s for s, _ in pieces]
            if not isinstance(error, OutOfMemoryError) or len(everyone) == 1:
                for seq in everyone:
                    self._fail(seq, error)
                return
            # the step's memory grows with its tokens and the longest cache: shed the biggest, retry
            victim = max(everyone, key=lambda s: s.prefilled + sum(len(c) for q, c in pieces if q is s))
            self._log(f"shedding request {victim.stream.request.request_id} to free memory")
            decodes = [s for s in decodes if s is not victim]
            pieces = [(s, c) for s, c in pieces if s is not victim]
            self._fail(victim, error)
        # every greedy pick of the step in one argmax and one copy to the host: the decodes' and the
        # first tokens of the prompts this step completes (a wave of 32 cached-prefix requests
        # otherwise copied 32 vocabulary-wide rows, one sync each, for an argmax on the CPU)
        firsts = [not seq.generated and seq.ready_after(len(chunk)) and seq.sampler.plain_greedy for seq, chunk in pieces]
        greedy = any(firsts) or any(seq.sampler.plain_greedy for seq in decodes)
        picks = logits.argmax(-1).tolist() if greedy else None
        if decodes:
            self._decoded(decodes, logits[:len(decodes)], picks[:len(decodes)] if picks else None)
        for i, (seq, chunk) in enumerate(pieces):
            row = len(decodes) + i
            self._prefilled(seq, chunk, logits[row], picks[row] if firsts[i] else None)

    def _run_piece(self, seq: RunningSequence, chunk: list[int]) -> None:
        """A prompt piece whose every position is scored, alone."""
        try:
            logits = self._scored_prefill(seq, chunk)
        except Exception as e:
            self._log(f"prefill of request {seq.stream.request.request_id} failed: {type(e).__name__}: {e}")
            self._fail(seq, EngineError.from_exception(e))
            return
        self._prefilled(seq, chunk, logits)

