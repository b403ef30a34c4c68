"""The engine interface: what the API layer needs from anything that generates tokens.

The API layer speaks only to `Engine` (submit a request, read an async stream of `TokenEvent`s,
cancel) and to `ModelTokenizer` (text <-> ids, chat template).  Both engines (`hf`, `gguf`) share
one scheduler (`scheduler.py`) and differ only in their `DecodeBackend` (`backend.py`), so a
faster decode core replaces the internals without touching the routes or the serving logic.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from quantserve.server.exceptions import (EngineClosedError, EngineError, OutOfMemoryError,  # noqa: F401
                                          QueueFullError, is_out_of_memory)
from quantserve.server.sampling import SamplingParams

_ids = itertools.count(1)


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))


@dataclass
class TopLogprob:
    token_id: int
    logprob: float


@dataclass
class TokenEvent:
    """One generated token, or the end of the stream (`finish_reason` set, token may be None)."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    finish_reason: str | None = None  # "stop" (eos), "length", "cancelled" or "error"
    error: EngineError | None = None  # with finish_reason "error"
    cached_tokens: int | None = None  # first token only: prompt tokens taken from the prefix cache
    queued_s: float | None = None  # first token only: seconds from submission to taking a slot
    # first event only, when asked for: (token, its logprob or None for the first, top alternatives)
    # for every prompt token
    prompt_logprobs: list[tuple[int, float | None, list[TopLogprob]]] | None = None
    embedding: list[float] | None = None  # an embedding request's result (its only event)
    # timing filled in by the scheduler, for metrics: seconds since the request was submitted
    elapsed_s: float = 0.0


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    generated_tokens: int = 0  # every token the engine sampled, since start
    cancelled: int = 0  # requests stopped early (client gone, stop string, shutdown)
    decode_steps: int = 0  # batched decode steps run, since start
    decode_rows: int = 0  # sequences those steps advanced: decode_rows / decode_steps is the mean batch
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of those, found there (not computed again)
    kv_blocks_used: int | None = None  # a paged KV cache's blocks held by live sequences (fast engine)
    kv_blocks_total: int | None = None
    preemptions: int = 0  # sequences sent back to wait for KV blocks (and computed again), since start

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0


@dataclass
class EngineInfo:
    """What `/v1/models` and `/health` report about the loaded model."""

    engine: str  # "hf" or "gguf"
    model_path: str
    context_length: int
    max_batch: int
    max_queue: int
    device: str
    dtype: str
    attention: str  # hf: flash_attention_2 / sdpa / eager; gguf: llama.cpp
    quantization: str | None = None
    # a paged KV cache's capacity in tokens (fast engine): no request may need more than all of it
    kv_pool_tokens: int | None = None
    extra: dict = field(default_factory=dict)


class ModelTokenizer(Protocol):
    eos_token_ids: set[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens; split UTF-8 characters come out as U+FFFD."""

    # optional: decode_stream(context ids) -> step(token id) -> text or None (an incomplete
    # character), an incremental decoder that textstream.py prefers to decoding windows

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (None: the model has none); tool calling reads it."""

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        """The chat template applied with the generation prompt (and the request's extra template
        variables); its text already holds BOS."""

    def grammar_tokenizer(self, n_vocab: int):
        """The vocabulary as llguidance sees it, for structured output (server/structured.py)."""


class TokenStream:
    """The async side of one request: iterate for `TokenEvent`s, `cancel()` to stop it early.

    The scheduler thread pushes events through `loop.call_soon_threadsafe` (`push_all`), so the
    event loop never blocks on the model.
    """

    def __init__(self, request: EngineRequest, loop: asyncio.AbstractEventLoop, engine: "Engine"):
        self.request = request
        self._loop = loop
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._engine = engine
        self.finished = False

    @staticmethod
    def push_all(events: list[tuple["TokenStream", TokenEvent]]) -> int:  # called from the scheduler thread
        """Hand many streams' events to their event loops with one wake-up each: a decode step's
        tokens at once, where a wake-up per token cost a syscall and a loop callback each, under
        the GIL the scheduler thread needs.  A stream without a loop gets them right here.
        Returns how many events could not be handed over (their event loop is closed: nobody is
        left to read them); the other loops still get theirs."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, event in events:
            if stream._loop is None:
                stream.deliver(event)
            else:
                by_loop.setdefault(stream._loop, []).append((stream, event))
        undelivered = 0
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # "Event loop is closed"
                undelivered += len(items)
        return undelivered

    def deliver(self, event: TokenEvent) -> None:
        self._queue.put_nowait(event)

    def cancel(self) -> None:
        if not self.finished:
            self._engine.cancel(self.request.request_id)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while not self.finished:
            event = await self._queue.get()
            if event.finish_reason is not None:
                self.finished = True
            yield event

    def ready(self) -> list[TokenEvent]:
        """The events already here, taken without waiting (those that came while the event loop
        was busy elsewhere), up to and including the last one."""
        events = []
        while not self.finished and not self._queue.empty():
            events.append(self._queue.get_nowait())
            self.finished = events[-1].finish_reason is not None
        return events


def _deliver_all(items: list[tuple[TokenStream, TokenEvent]]) -> None:
    for stream, event in items:
        stream.deliver(event)


class Engine(Protocol):
    info: EngineInfo
    tokenizer: ModelTokenizer

    def submit(self, requests: list[EngineRequest]) -> list[TokenStream]:
        """Queue one API request's sequences together, all or none (raises QueueFullError /
        EngineClosedError at once, never later)."""

    def cancel(self, request_id: int) -> None:
        """Stop a request and free its KV memory; its stream ends with finish_reason "cancelled"."""

    def stats(self) -> EngineStats: ...

    def is_ready(self) -> bool: ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the model (blocking; called from a worker thread) and start the scheduler."""

    def shutdown(self, grace_s: float) -> None:
        """Refuse new work, let running requests finish for up to `grace_s`, cancel the rest."""
