"""`/v1/chat/completions`: messages rendered with the tokenizer's chat template; tool calls read
out of the reply (tools.py, tool_parsers.py), streamed or not."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from quantserve.server.errors import APIError
from quantserve.server.protocol import ChatCompletionRequest
from quantserve.server.protocol_replies import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                                ChatCompletionChunk, ChoiceLogprobs, DeltaFunctionCall, DeltaMessage,
                                                DeltaToolCall, FunctionCall, TokenLogprobOut, ToolCall, TopLogprobOut)
from quantserve.server.serving import (Job, ServerState, check_model, collect, new_id, output_format, run_job,
                                       run_to_reply, sse_error, start_job)
from quantserve.server.textstream import LogprobEntry
from quantserve.server.tokenizing import encode_all
from quantserve.server.unsupported import refuse_unsupported
from quantserve.server.exceptions import NoChatTemplateError, RequestFieldError


# What chat_template_kwargs cannot set: the variables the server itself passes to the template
# (tools: set by the request's `tools` field), and transformers' apply_chat_template arguments,
# which would not reach the template as variables but change the rendering itself (a template of
# the request's own, token ids instead of text) and which the gguf engine's renderer ignores.
RESERVED_TEMPLATE_VARIABLES = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                               "chat_template", "conversation", "tokenize", "return_dict", "return_tensors",
                               "continue_final_message", "padding", "truncation", "max_length",
                               "return_assistant_tokens_mask", "tokenizer_kwargs"}


def tool_format(state: ServerState):
    """The model's tool-call format, bound to its tokenizer's special tokens (tool_parsers.for_tokenizer)."""
    from quantserve.server.tool_parsers import FORMATS, detect, for_tokenizer

    tokenizer = state.engine.tokenizer
    fmt = detect(tokenizer.chat_template) if state.tool_call_parser == "auto" else FORMATS[state.tool_call_parser]
    return for_tokenizer(fmt, tokenizer)


def tool_plan(state: ServerState, req: ChatCompletionRequest):
    from quantserve.server.tools import ToolError, plan

    try:
        return plan(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format(state))
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None


def conversation(state: ServerState, req: ChatCompletionRequest, plan) -> tuple[list[dict], dict]:
    """The messages and extra template variables to render: tools and earlier calls as the
    template expects them, or written out by the fallback when it knows no tools."""
    from quantserve.server.tools import ToolError, history_call, render_fallback, template_knows_tools

    template = state.engine.tokenizer.chat_template or ""
    messages = []
    for i, m in enumerate(req.messages):
        # OpenAI's developer role is the system role of models without one of their own
        role = "system" if m.role == "developer" and "developer" not in template else m.role
        msg = {"role": role, "content": m.text()}
        if m.name is not None:  # as vLLM does: templates that know names use them
            msg["name"] = m.name
        try:
            if m.tool_calls:
                msg["tool_calls"] = [history_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m.tool_calls)]
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    has_tools = plan is not None or any("tool_calls" in m or m["role"] == "tool" for m in messages)
    if not has_tools:
        return messages, {}
    if template_knows_tools(state.engine.tokenizer.chat_template):
        return messages, {"tools": plan.tools} if plan is not None else {}
    return render_fallback(messages, plan, tool_format(state)), {}


async def render_prompt(state: ServerState, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    tok = state.engine.tokenizer
    try:  # off the event loop: a long conversation's template (a Jinja loop) must not stall other requests
        text = await asyncio.to_thread(tok.render_chat, messages, **(template_kwargs or {}))
    except NoChatTemplateError as e:
        raise APIError(400, str(e), param="messages", code="no_chat_template") from e
    except Exception as e:  # template errors (e.g. roles the template refuses) are the caller's
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    # the rendered text already holds BOS and the special tokens: no second BOS
    return (await encode_all(tok, [text], add_special_tokens=False))[0]


def _logprobs_out(entries: list[LogprobEntry]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprobOut(token=e.token, logprob=e.logprob, bytes=e.token_bytes,
                        top_logprobs=[TopLogprobOut(token=t, logprob=lp, bytes=b) for t, b, lp in e.top])
        for e in entries])


def format_into_tools(state: ServerState, req: ChatCompletionRequest) -> tuple[ChatCompletionRequest, str | None]:
    """Strict tools under "auto" with a response format (the Agents SDK's output_type): one
    grammar holds both, a reply that is the format's JSON or calls that validate.  Returns the
    request without its format, and the format's JSON schema (None: no format)."""
    fmt = output_format(state, req)
    if fmt is None:
        return req, None
    if fmt.kind != "json":
        raise APIError(400, f"{fmt.param}: with strict tools under tool_choice auto, only a JSON response format "
                       "is served (one grammar holds the answer and the calls)", param=fmt.param)
    cleared = dict.fromkeys(["response_format", "structured_outputs", *req.guided()])
    return req.model_copy(update=cleared), fmt.text


async def prepare(state: ServerState, req: ChatCompletionRequest):
    """(the job, its tool plan or None)."""
    from quantserve.server.structured import OutputFormat

    check_model(state, req.model)
    refuse_unsupported(req, chat=True)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if (req.top_logprobs or 0) > state.max_logprobs:
        raise APIError(400, f"at most {state.max_logprobs} top logprobs are returned (asked for {req.top_logprobs})",
                       param="top_logprobs")
    reserved = RESERVED_TEMPLATE_VARIABLES & set(req.chat_template_kwargs or {})
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {sorted(reserved)[0]!r}", param="chat_template_kwargs")
    plan = tool_plan(state, req)
    answer_schema = None
    if plan is not None and plan.strict:
        req, answer_schema = format_into_tools(state, req)
    messages, tool_kwargs = conversation(state, req, plan)
    prompt = await render_prompt(state, messages, {**(req.chat_template_kwargs or {}), **tool_kwargs})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        grammar = plan.grammar(answer_schema) if plan is not None else None
    except RequestFieldError as e:
        raise APIError(400, str(e), param=e.param) from None
    forced = OutputFormat("grammar", grammar, "tools" if plan.strict else "tool_choice") if grammar else None
    kept = plan.fmt.kept_tokens() if plan is not None and plan.parses else None  # markers that are special tokens
    return start_job(state, req, [prompt], max_tokens, logprobs, "messages", forced, kept_tokens=kept), plan


def reply_message(text: str, finish_reason: str | None, plan) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished choice: its tool calls read out of the text when the
    request has tools to parse, with finish_reason "tool_calls" then."""
    if plan is None or not plan.parses:
        return AssistantMessage(content=text), finish_reason
    content, calls = plan.fmt.parse(text)
    if not calls:
        return AssistantMessage(content=text), finish_reason
    if not plan.parallel:
        calls = calls[:1]
    tool_calls = [ToolCall(id=new_id("call"), function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in calls]
    return (AssistantMessage(content=content or None, tool_calls=tool_calls),
            "tool_calls" if finish_reason == "stop" else finish_reason)


async def complete(state: ServerState, req: ChatCompletionRequest, request) -> ChatCompletion:
    job, plan = await prepare(state, req)
    await run_to_reply(job, request, collect(state, job))
    choices = []
    for i, c in enumerate(job.choices):
        message, finish = reply_message(c.text, c.finish_reason, plan)
        choices.append(ChatChoice(index=i, message=message, finish_reason=finish,
                                  logprobs=_logprobs_out(c.all_logprobs) if req.logprobs else None))
    return ChatCompletion(id=new_id("chatcmpl"), model=state.model_name, choices=choices, usage=job.usage())


class ToolCallStream:
    """Streams a choice's text as content until a tool call may begin, then holds the rest; at the
    end, the held text is parsed like a non-streamed reply: calls, or content after all."""

    def __init__(self, plan):
        self.plan, self.start = plan, plan.fmt.start
        self.text = ""  # everything the choice wrote
        self.sent = 0  # how much of it went out as content
        self.holding = False  # a call's start marker was seen

    def push(self, text: str) -> str:
        """The content to send now."""
        self.text += text
        if self.holding:
            return ""
        at = self.text.find(self.start, self.sent)
        if at >= 0:
            self.holding = True
            return self._send_to(at)
        # keep back a tail that could be the marker's beginning
        keep = next((k for k in range(min(len(self.start) - 1, len(self.text) - self.sent), 0, -1)
                     if self.text.endswith(self.start[:k])), 0)
        return self._send_to(len(self.text) - keep)

    def _send_to(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[DeltaToolCall], str | None]:
        """(content still to send, the calls as deltas, the finish reason)."""
        message, finish = reply_message(self.text, finish_reason, self.plan)
        if not message.tool_calls:
            return self._send_to(len(self.text)), [], finish
        deltas = [DeltaToolCall(index=k, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                  for k, call in enumerate(message.tool_calls)]
        return "", deltas, finish


async def stream(state: ServerState, req: ChatCompletionRequest, job: Job, plan=None) -> AsyncIterator[str]:
    cid = new_id("chatcmpl")
    tool_streams = {i: ToolCallStream(plan) for i in range(len(job.choices))} if plan is not None and plan.parses else {}
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)

    def chunk(choices, usage=None) -> str:
        if continuous and usage is None:
            usage = job.usage()  # the tokens so far
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
            if i not in tool_streams:
                content = delta.text if delta.text else None
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=content), logprobs=lp,
                                             finish_reason=delta.finish_reason)])
                continue
            calls = tool_streams[i]
            content = calls.push(delta.text)
            if content or lp:
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=content or None), logprobs=lp)])
            if delta.finish_reason:
                rest, deltas, finish = calls.finish(delta.finish_reason)
                if rest:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=rest))])
                if deltas:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(tool_calls=deltas))])
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=finish)])
        if include_usage:
            yield chunk([], job.usage())
        job.settle("error" if job.first_error else "success")
        yield "data: [DONE]\n\n"
    except Exception:
        job.settle("error")
        raise
    finally:
        job.cancel()  # settles "disconnected" when the client left before the end
