"""`/v1/chat/completions`: messages rendered with the tokenizer's chat template."""

from __future__ import annotations

from typing import AsyncIterator

from quantserve.server.errors import APIError
from quantserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                             ChatCompletionChunk, ChatCompletionRequest, ChoiceLogprobs, DeltaMessage,
                             TokenLogprobOut, TopLogprobOut)
from quantserve.server.serving import (Job, ServerState, check_model, collect, new_id, run_job,
                            run_to_reply, sse_error, start_job)
from quantserve.server.textstream import LogprobEntry
from quantserve.server.unsupported import refuse_unsupported
from quantserve.server.exceptions import NoChatTemplateError


def render_prompt(state: ServerState, messages, template_kwargs: dict | None = None) -> list[int]:
    tok = state.engine.tokenizer
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(template_kwargs or {})
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {sorted(reserved)[0]!r}", param="chat_template_kwargs")
    try:
        text = tok.render_chat([{"role": m.role, "content": m.text()} for m in messages], **(template_kwargs or {}))
    except NoChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="no_chat_template") from e
    except Exception as e:  # template errors (e.g. roles the template refuses) are the caller's
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    # the rendered text already holds BOS and the special tokens: no second BOS
    return tok.encode(text, add_special_tokens=False)


def _logprobs_out(entries: list[LogprobEntry]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprobOut(token=e.token, logprob=e.logprob, bytes=e.token_bytes,
                        top_logprobs=[TopLogprobOut(token=t, logprob=lp, bytes=b) for t, b, lp in e.top])
        for e in entries])


def prepare(state: ServerState, req: ChatCompletionRequest) -> Job:
    check_model(state, req.model)
    refuse_unsupported(req, chat=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = render_prompt(state, req.messages, req.chat_template_kwargs)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return start_job(state, req, [prompt], max_tokens, logprobs, "messages")


async def complete(state: ServerState, req: ChatCompletionRequest, request) -> ChatCompletion:
    job = prepare(state, req)
    await run_to_reply(job, request, collect(state, job))
    choices = [ChatChoice(index=i, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=_logprobs_out(c.all_logprobs) if req.logprobs else None)
               for i, c in enumerate(job.choices)]
    return ChatCompletion(id=new_id("chatcmpl"), model=state.model_name, choices=choices, usage=job.usage())


async def stream(state: ServerState, req: ChatCompletionRequest, job: Job) -> AsyncIterator[str]:
    cid = new_id("chatcmpl")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices, usage=None) -> str:
        c = ChatCompletionChunk(id=cid, model=state.model_name, choices=choices, usage=usage)
        return f"data: {c.model_dump_json()}\n\n"

    try:
        # OpenAI opens every choice with a role-only delta
        for i in range(len(job.choices)):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        async for i, delta in run_job(state, job):
            if delta.finish_reason == "error":  # an error event instead of a finish_reason
                yield sse_error(job.choices[i].error)
                continue
            lp = _logprobs_out(delta.logprobs) if req.logprobs and delta.logprobs else None
            content = delta.text if delta.text else None
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=content), logprobs=lp,
                                         finish_reason=delta.finish_reason)])
        if include_usage:
            yield chunk([], job.usage())
        job.settle("error" if job.first_error else "success")
        yield "data: [DONE]\n\n"
    except Exception:
        job.settle("error")
        raise
    finally:
        job.cancel()  # settles "disconnected" when the client left before the end
