"""`/v1/completions`: raw prompts (text or token ids, one or a list), the legacy response shape."""

from __future__ import annotations

from typing import AsyncIterator

from quantserve.server.errors import APIError
from quantserve.server.protocol import CompletionRequest
from quantserve.server.protocol_replies import Completion, CompletionChoice, CompletionLogprobs
from quantserve.server.serving import (Job, ServerState, check_model, collect, new_id, run_job,
                            run_to_reply, sse_error, start_job, tokenized)
from quantserve.server.textstream import LogprobEntry
from quantserve.server.unsupported import refuse_unsupported

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default


def _legacy_logprobs(*parts: tuple[list[LogprobEntry], int]) -> CompletionLogprobs:
    """OpenAI's legacy shape of (entries, base) parts; text_offset: where each token starts in the
    choice's text (base: 0 for the prompt's own tokens, the echoed prompt's length for generated ones)."""
    out = CompletionLogprobs()
    for entries, base in parts:
        for e in entries:
            out.text_offset.append(base + e.offset)
            out.tokens.append(e.token)
            out.token_logprobs.append(e.logprob)
            top = {t: lp for t, _, lp in e.top}
            if e.logprob is not None:  # OpenAI always includes the chosen token: up to logprobs + 1 entries
                top.setdefault(e.token, e.logprob)
            out.top_logprobs.append(top or None)
    return out


async def prepare(state: ServerState, req: CompletionRequest) -> tuple[Job, list[str]]:
    check_model(state, req.model)
    refuse_unsupported(req, chat=False)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens 0 asks for nothing: it is only allowed with echo (to score the prompt)",
                       param="max_tokens")
    prompts, texts = await tokenized(state.engine.tokenizer, req.prompt, "prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    # echo with logprobs: the prompt's own log-probabilities too (lm-evaluation-harness's log-likelihood)
    scored = req.logprobs if req.echo and req.logprobs is not None else None
    job = start_job(state, req, prompts, max_tokens, req.logprobs, "prompt", prompt_logprobs=scored,
                    end_token_logprobs=True)
    for i, choice in enumerate(job.choices):  # the prompt's offsets point into the echoed text
        choice.prompt_text = texts[i // req.n]
    return job, texts


async def complete(state: ServerState, req: CompletionRequest, request) -> Completion:
    job, texts = await prepare(state, req)
    await run_to_reply(job, request, collect(state, job))
    choices = []
    for i, c in enumerate(job.choices):
        prefix = texts[i // req.n] if req.echo else ""
        logprobs = None
        if req.logprobs is not None:  # the prompt's entries are there only with echo
            logprobs = _legacy_logprobs((c.prompt_logprobs, 0), (c.all_logprobs, len(prefix)))
        choices.append(CompletionChoice(index=i, text=prefix + c.text, finish_reason=c.finish_reason,
                                        logprobs=logprobs))
    return Completion(id=new_id("cmpl"), model=state.model_name, choices=choices, usage=job.usage())


async def stream(state: ServerState, req: CompletionRequest, job: Job, texts: list[str]) -> AsyncIterator[str]:
    cid = new_id("cmpl")
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)

    def event(c: Completion) -> str:
        if continuous and c.usage is None:
            c.usage = job.usage()  # the tokens so far
        return _sse(c)

    scored = req.echo and req.logprobs is not None
    echoed = [False] * len(job.choices)
    try:
        if req.echo and not scored:
            for i in range(len(job.choices)):
                yield event(Completion(id=cid, model=state.model_name,
                                       choices=[CompletionChoice(index=i, text=texts[i // req.n])]))
        async for i, delta in run_job(state, job):
            if scored and not echoed[i]:  # the echoed prompt with its logprobs, once they are known
                echoed[i] = True
                prompt_lp = _legacy_logprobs((job.choices[i].prompt_logprobs, 0))
                yield event(Completion(id=cid, model=state.model_name, choices=[
                    CompletionChoice(index=i, text=texts[i // req.n], logprobs=prompt_lp)]))
            base = len(texts[i // req.n]) if req.echo else 0
            lp = _legacy_logprobs((delta.logprobs, base)) if req.logprobs is not None else None
            if delta.finish_reason == "error":  # an error event instead of a finish_reason
                yield sse_error(job.choices[i].error)
                continue
            chunk = Completion(id=cid, model=state.model_name, choices=[
                CompletionChoice(index=i, text=delta.text, logprobs=lp, finish_reason=delta.finish_reason)])
            yield event(chunk)
        if include_usage:
            yield event(Completion(id=cid, model=state.model_name, choices=[], usage=job.usage()))
        job.settle("error" if job.first_error else "success")
        yield "data: [DONE]\n\n"
    except Exception:
        job.settle("error")
        raise
    finally:
        job.cancel()  # settles "disconnected" when the client left before the end


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"
