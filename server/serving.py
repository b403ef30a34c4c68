"""Serving logic shared by completions and chat: validate, turn a request into engine requests,
and run their token streams into choices (merged for streaming, collected otherwise).

Routes live in `api_server.py`; the two endpoint-specific shapes live in `serving_completions.py`
and `serving_chat.py`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from quantserve.server.config import APIOptions
from quantserve.server.engine import EngineClosedError, EngineError, EngineRequest, QueueFullError, TokenStream
from quantserve.server.errors import APIError, engine_status, error_body
from quantserve.server.metrics import Metrics
from quantserve.server.middleware import ARRIVAL
from quantserve.server.protocol import _SamplingFields
from quantserve.server.protocol_replies import PromptTokensDetails, Usage
from quantserve.server.sampling import SamplingParams
from quantserve.server.textstream import ChoiceText, Delta
from quantserve.server.tokenizing import encode_all

log = logging.getLogger("quantserve.server")


@dataclass
class ServerState:
    engine: object  # an Engine
    model_name: str
    metrics: Metrics
    max_logprobs: int = APIOptions.max_logprobs
    retry_after_s: int = 1
    tool_call_parser: str = "auto"  # a tool_parsers.FORMATS name, or auto: guessed from the chat template
    load_error: str | None = None  # why the model failed to load, once it has


@dataclass
class Job:
    """All engine streams of one API request: one per (prompt, n) pair, in choice order."""

    streams: list[TokenStream]
    choices: list[ChoiceText]
    prompt_tokens: int
    metrics: Metrics | None = None
    n: int = 1  # choices per prompt: choices[i * n] is prompt i's first
    # when the request reached the server (middleware.ArrivalMiddleware; now, outside a request):
    # its time to first token and latency count from there
    started: float = field(default_factory=lambda: ARRIVAL.get(None) or time.perf_counter())
    outcome: str | None = None  # set once by settle()

    def settle(self, outcome: str) -> None:
        """Count how the request ended (success, error, disconnected); only the first call counts."""
        if self.outcome is None:
            self.outcome = outcome
            if self.metrics is not None:
                self.metrics.record_outcome(outcome, self.completion_tokens)

    def cancel_streams(self) -> None:
        for s in self.streams:
            s.cancel()

    def cancel(self) -> None:
        """The response is over (the route's close callback): a request not settled by then was
        abandoned by its client.  Unfinished streams are cancelled, which frees their KV memory."""
        self.settle("disconnected")
        self.cancel_streams()

    def usage(self) -> Usage:
        # prompt tokens count once per prompt, however many choices it has: so do cached ones
        cached = sum(c.cached_tokens for c in self.choices[::self.n])
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    @property
    def first_error(self):
        """The EngineError of the first failed choice, or None."""
        return next((c.error for c in self.choices if c.finish_reason == "error"), None)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


async def tokenized(tokenizer, value, param: str) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of a prompt-shaped field (a string, strings, token ids or lists of them:
    completions' `prompt`, embeddings' `input`); texts get the tokenizer's special tokens (long
    ones encoded off the event loop: tokenizing.py)."""
    if isinstance(value, str):
        texts = [value]
    elif value and all(isinstance(x, int) for x in value):
        return [_in_vocab(tokenizer, list(value), param)], [tokenizer.decode(list(value))]
    elif value and all(isinstance(x, list) for x in value):
        return [_in_vocab(tokenizer, list(x), param) for x in value], [tokenizer.decode(list(x)) for x in value]
    elif value and all(isinstance(x, str) for x in value):
        texts = list(value)
    else:
        raise APIError(400, f"{param} must be a string, a list of strings, or token ids", param=param)
    return await encode_all(tokenizer, texts, add_special_tokens=True), texts


def _in_vocab(tokenizer, ids: list[int], param: str) -> list[int]:
    """Checked before anything decodes them: llama.cpp's detokenizer crashes on an id past its vocabulary."""
    if any(not 0 <= t < tokenizer.vocab_size for t in ids):
        raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param=param)
    return ids


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, name: str | None) -> None:
    """A request names the served model, or none (then it means that one)."""
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{state.model_name}'.",
                       param="model", code="model_not_found")


def logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON keys) -> a bias in [-100, 100] added to the logit."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):  # int() would also take " 5 ", "+6", "0_7" and "٥"
            raise APIError(400, f"logit_bias keys are token ids, not {key[:40]!r}", param="logit_bias")
        digits = key.lstrip("0") or "0"  # int() refuses strings past 4,300 digits, leading zeros included
        token = int(digits) if len(digits) <= len(str(vocab)) else vocab
        if not 0 <= token < vocab:
            shown = key if len(key) <= 20 else f"{key[:20]}... ({len(key)} digits)"
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab}) (got {shown})", param="logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100] (got {value} for token {token})",
                           param="logit_bias")
        out[token] = value
    return out


def output_format(state: ServerState, req: _SamplingFields, forced=None):
    """The structured-output format the request asks for (None: free text), checked.  `forced`
    is one the server sets (a required tool call's grammar): the request may not add its own."""
    from quantserve.server.structured import GrammarError, output_format as parse

    try:
        fmt = parse(req.response_format, req.structured_outputs, req.guided())
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
    if forced is not None:
        if fmt is not None:
            raise APIError(400, f"{fmt.param} cannot be combined with a tool call the server constrains "
                           f"({forced.param}: required, named or strict): its grammar already fixes the reply's "
                           "format", param=fmt.param)
        fmt = forced
    if fmt is not None:
        if getattr(state.engine, "grammars", None) is None:
            raise APIError(400, "structured output is not available on this engine", param=fmt.param)
        if req.ignore_eos:
            raise APIError(400, "ignore_eos cannot be combined with a structured output format: the "
                           "reply ends where the format is complete", param="ignore_eos")
    return fmt


def constraint_for(state: ServerState, fmt):
    from quantserve.server.structured import GrammarError

    try:
        return state.engine.grammars.matcher(fmt)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None


def sampling_params(state: ServerState, req: _SamplingFields, prompt_len: int, max_tokens: int | None,
                    logprobs: int | None, param: str, choice_index: int, fmt=None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    # the format first: a schema that cannot compile is the more specific error
    constraint = constraint_for(state, fmt) if fmt is not None else None
    info = state.engine.info
    context = info.context_length
    pool = info.kv_pool_tokens if info.kv_pool_tokens is not None and info.kv_pool_tokens < context else None
    if max_tokens is None:
        max_tokens = min(context, pool or context) - prompt_len
        if max_tokens < 1 and pool is None:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, your "
                           f"{param} is {prompt_len} tokens, leaving no room for a completion.",
                           param=param, code="context_length_exceeded")
    if prompt_len + max_tokens > context:
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                       f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {param}, "
                       f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                       "the completion.", param=param, code="context_length_exceeded")
    if pool is not None and prompt_len + max(max_tokens, 1) > pool:
        raise APIError(400, f"The server's KV cache holds {pool} tokens in all ({pool // 16} blocks of 16), "
                       f"fewer than this request needs alone: {prompt_len + max(max_tokens, 1)} "
                       f"({prompt_len} in the {param}, {max(max_tokens, 1)} in the completion). Please reduce "
                       f"the length of the {param} or the completion.", param=param, code="context_length_exceeded")
    if logprobs is not None and logprobs > state.max_logprobs:
        raise APIError(400, f"at most {state.max_logprobs} top logprobs are returned (asked for {logprobs})",
                       param="logprobs")
    return req.to_sampling_params(max_tokens, choice_index, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  logit_bias=logit_bias(req.logit_bias, state.engine.tokenizer.vocab_size),
                                  constraint=constraint)


# The most sequences (prompts x n, or embedding inputs) one request may hold: OpenAI's limit on an
# embeddings request's inputs.  They enter the engine's queue together (scheduler.py), so this, not
# --max-queue, bounds one request.
MAX_SEQUENCES = 2048


def check_sequences(count: int, what: str, param: str) -> None:
    if count > MAX_SEQUENCES:
        raise APIError(400, f"{count} {what} in one request; at most {MAX_SEQUENCES} are allowed", param=param)


def start_job(state: ServerState, req: _SamplingFields, prompts: list[list[int]], max_tokens: int | None,
              logprobs: int | None, param: str, forced_format=None, prompt_logprobs: int | None = None,
              end_token_logprobs: bool = False, kept_tokens: dict[int, str] | None = None) -> Job:
    """Validate everything first, then submit all choices together (the engine takes all or none).
    kept_tokens: special token ids written into the reply's text (a tool format's markers)."""
    engine = state.engine
    check_sequences(len(prompts) * req.n, "choices (prompts x n)", "n" if req.n > 1 else param)
    vocab = engine.tokenizer.vocab_size
    fmt = output_format(state, req, forced_format)
    if any(not 0 <= t < vocab for t in req.stop_token_ids or []):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    planned = []
    for prompt in prompts:
        if not prompt:
            raise APIError(400, f"the {param} is empty", param=param)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", param=param)
        for j in range(req.n):
            planned.append((prompt, sampling_params(state, req, len(prompt), max_tokens, logprobs, param,
                                                    len(planned), fmt, prompt_logprobs)))
    choices = [ChoiceText(engine.tokenizer, prompt, req.stop_list(), logprobs is not None, end_token_logprobs,
                          kept_tokens) for prompt, _ in planned]
    state.metrics.received.inc()
    try:
        streams = engine.submit([EngineRequest(prompt, params) for prompt, params in planned])
    except (QueueFullError, EngineClosedError) as e:
        state.metrics.record_outcome("rejected", 0)
        status, code = engine_status(e)
        state.metrics.rejected.labels(str(status)).inc()
        if isinstance(e, EngineClosedError):
            raise APIError(status, str(e), code=code) from e
        raise APIError(status, f"Server busy: {e}. Retry later.", code=code,
                       headers={"Retry-After": str(state.retry_after_s)}) from e
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    return Job(streams, choices, prompt_tokens=sum(len(p) for p in prompts), metrics=state.metrics, n=req.n)


async def run_job(state: ServerState, job: Job) -> AsyncIterator[tuple[int, Delta]]:
    """Yield (choice index, delta) as tokens arrive from all the job's streams, interleaved.

    Closing this generator early (client gone, error) cancels every unfinished stream, which frees
    its slot and KV memory in the engine at the next token boundary.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await _pump(i)
        except Exception as e:  # never leave the request hanging: end the choice with an error
            log.exception("choice %d failed", i)
            choice = job.choices[i]
            choice.finish_reason, choice.error = "error", EngineError.from_exception(e)
            job.streams[i].cancel()
            await queue.put((i, Delta("", [], "error")))
        await queue.put((i, None))

    async def put(i: int, delta: Delta) -> None:
        if delta.text or delta.logprobs or delta.finish_reason:
            await queue.put((i, delta))

    async def _pump(i: int) -> None:
        stream, choice = job.streams[i], job.choices[i]
        first = None
        async for event in stream:
            # the events that came while the loop was busy go out as one delta (vLLM merges a
            # request's outputs the same way when its client falls behind): one chunk to build
            # and send instead of several, so a loaded loop catches up instead of falling further
            delta = None
            for ev in [event, *stream.ready()]:
                if first is None and ev.token_id is not None:
                    first = time.perf_counter() - job.started
                    if ev.queued_s is not None:
                        state.metrics.record_engine_first_token(ev.queued_s, ev.elapsed_s)
                piece = choice.push(ev)
                if piece.finish_reason == "error" and delta is not None:
                    await put(i, delta)  # an error event replaces its chunk: the text before it goes first
                    delta = None
                delta = piece if delta is None else delta.then(piece)
                if piece.finish_reason:
                    break
            await put(i, delta)
            if delta.finish_reason:
                stream.cancel()  # a stop string ends the choice before the engine would
                state.metrics.record_choice(first, time.perf_counter() - job.started,
                                            choice.completion_tokens, delta.finish_reason)
                break

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(job.streams))]
    try:
        remaining = len(tasks)
        while remaining:
            i, delta = await queue.get()
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        job.cancel_streams()
        for t in tasks:
            t.cancel()


async def collect(state: ServerState, job: Job) -> None:
    """Run a job to the end (non-streaming); each ChoiceText then holds its full text.  The first
    failed choice ends the job at once (the others are cancelled): the reply is an error anyway."""
    async for _, delta in run_job(state, job):
        if delta.finish_reason == "error":
            break
    raise_if_failed(job)


def api_error_of(error) -> APIError:
    """The error reply for a failed choice, status and code from `errors.ENGINE_ERRORS`."""
    status, code = engine_status(error)
    return APIError(status, f"generation failed: {error}", code=code)


def raise_if_failed(job: Job) -> None:
    if job.first_error is not None:
        raise api_error_of(job.first_error)


def sse_error(error) -> str:
    """The streaming form of a failed choice: an OpenAI error object as one SSE event (vLLM's way)."""
    e = api_error_of(error)
    return f"data: {json.dumps(error_body(e.status, e.message, code=e.code))}\n\n"


async def run_to_reply(job: Job, request, coro):
    """Await a non-streaming job's `coro` (which ends with `raise_if_failed`) and settle the job:
    success, error, or disconnected when the client left before the reply."""
    try:
        result = await until_disconnected(request, coro)
    except APIError as e:
        job.settle("disconnected" if e.status == 499 else "error")
        raise
    except asyncio.CancelledError:  # the connection was torn down under us
        job.settle("disconnected")
        raise
    except BaseException:
        job.settle("error")
        raise
    job.settle("success")
    return result


async def until_disconnected(request, coro, poll_s: float = 0.25):
    """Await `coro`, but cancel it if the HTTP client goes away first (non-streaming requests)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            # a cancelled asyncio.gather ends with CancelledError as its *exception*, which asyncio
            # logs as "never retrieved" unless someone reads it
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
