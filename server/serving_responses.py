"""`/v1/responses`: OpenAI's Responses API (what the newest SDKs and LangChain's
`use_responses_api=True` call), served by translating each request into a chat completion.

Stateless: nothing is stored, so `previous_response_id`, `store: true` and `background` are
refused with a 400 that says why; a conversation is sent whole in `input`, its earlier tool calls
and their outputs as `function_call` / `function_call_output` items.  `instructions` become the
system message; `text.format` is chat's `response_format`; function `tools` and `tool_choice`
are chat's in the Responses API's flat shape.  Output is a `message` item with `output_text`, and
a `function_call` item per tool call; streamed, the events are the Responses API's own
(`response.created` ... `response.output_text.delta` ... `response.completed`), each numbered.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError

from quantserve.server.errors import APIError
from quantserve.server.protocol import ChatCompletionRequest, ResponsesRequest
from quantserve.server.serving import ServerState, collect, new_id, run_job, run_to_reply
from quantserve.server.unsupported import refuse_fields

# fields with no chat counterpart: allowed at these values only (value -> why refused otherwise)
_REFUSED = {
    "previous_response_id": ((None,), "this server stores no responses (stateless): send the whole "
                             "conversation in input instead of previous_response_id"),
    "store": ((None, False), "this server stores no responses (stateless): send store: false"),
    "background": ((None, False), "background responses need storage, which this server does not keep"),
    "conversation": ((None,), "this server stores no conversations: send the whole conversation in input"),
    "prompt": ((None,), "stored prompt templates are not supported by this server"),
    "reasoning": ((None, {}, {"effort": None}, {"summary": None}), "this model has no reasoning mode"),
    "include": ((None, []), "include is not supported by this server (no extra output data to add)"),
    "truncation": ((None, "disabled"), "prompts are never truncated here: a long one gets a 400"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported by this server"),
    "top_logprobs": ((None, 0), "logprobs on /v1/responses are not supported (use /v1/chat/completions)"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "stream_options": ((None, {}, {"include_obfuscation": False}),
                       "only include_obfuscation false is served (no obfuscation padding)"),
}
_HINTS = {"user", "metadata", "safety_identifier", "prompt_cache_key"}
# text's fields (value -> why refused otherwise); `format` is translated below
_TEXT_REFUSED = {"verbosity": ((None,), "verbosity cannot be honoured by this server")}


def to_chat(req: ResponsesRequest) -> tuple[ChatCompletionRequest, "Origins"]:
    """The chat completion request that answers `req` and where its messages came from in `req`, or
    a 400 naming what cannot be served."""
    refuse_fields(dict(req.model_extra or {}), _REFUSED, _HINTS, "the Responses API")
    if (req.model_extra or {}).get("stream_options") is not None and not req.stream:
        raise APIError(400, "stream_options: only allowed with stream true", param="stream_options")
    origins = Origins()
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req, origins), "stream": req.stream,
                            "max_completion_tokens": req.max_output_tokens}
    for name in ("temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "seed",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "ignore_eos"):
        value = getattr(req, name, None)
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            _only(choice, {"type", "name"}, "tool_choice")
            choice = {"type": "function", "function": {"name": _required_string(choice, "name", "tool_choice")}}
        body["tool_choice"] = choice
    fmt = _text_format(req.text)
    if fmt and fmt.get("type") != "text":
        if fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        else:
            body["response_format"] = fmt
    try:
        return ChatCompletionRequest.model_validate(body), origins
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")  # pydantic's prefix to our own checks' messages
        raise origins.rename(APIError(400, f"{path}: {message}", param=path)) from None


class Origins:
    """Where each chat message (and each tool call in one) came from in the Responses request, so
    that an error the chat completion raises names the request's own fields: `input.2.arguments`,
    not `messages.1.tool_calls.0.function.arguments`, which this request has no such thing as."""

    _CHAT = re.compile(r"\bmessages\.(\d+)(?:\.tool_calls\.(\d+))?((?:\.[A-Za-z_]+)*)")
    _RENAMES = [(re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
                (re.compile(r"\btools\.(\d+)\.function\b"), r"tools.\1"),
                (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
                (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "text.format")]

    def __init__(self):
        self.messages: list[tuple[str, str]] = []  # (path in the request, role) of each chat message
        self.calls: dict[tuple[int, int], str] = {}  # (message, call) -> its function_call item

    def rename(self, error: APIError) -> APIError:
        error.message = self._renamed(error.message)
        error.param = self._renamed(error.param) if error.param else error.param
        return error

    def _renamed(self, text: str) -> str:
        for pattern, name in self._RENAMES:
            text = pattern.sub(name, text)
        return self._CHAT.sub(self._path, text)

    def _path(self, match: re.Match) -> str:
        m, call, rest = int(match[1]), match[2], match[3].lstrip(".")
        if m >= len(self.messages):
            return match[0]
        where, role = self.messages[m]
        if call is not None:
            where = self.calls.get((m, int(call)), where)
            rest = {"function.name": "name", "function.arguments": "arguments", "id": "call_id",
                    "function": ""}.get(rest, rest)
        elif where in ("instructions", "input"):  # a string field of the request is the content itself
            rest = "" if rest == "content" else rest
        else:
            rest = {"tool_call_id": "call_id", "content": "output" if role == "tool" else "content"}.get(rest, rest)
        return f"{where}.{rest}" if rest else where


def _text_format(text) -> dict | None:
    """`text.format` (None: plain text), its other fields refused by name where not honoured."""
    if text is None:
        return None
    extras = {k: v for k, v in text.items() if k != "format"}
    refuse_fields(extras, _TEXT_REFUSED, set(), "the Responses API's text")
    fmt = text.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type"), str)):
        raise APIError(400, "text.format: an object with a type (text, json_schema or json_object)",
                       param="text.format")
    if fmt is not None:
        _only(fmt, {"type", "name", "schema", "strict", "description"} if fmt["type"] == "json_schema" else {"type"},
              "text.format")
    return fmt


# what each input item may hold: its own fields, and the id and status of an output item sent back
_ITEM_FIELDS = {"message": {"type", "role", "content", "id", "status"},
                "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
                "function_call_output": {"type", "call_id", "output", "id", "status"}}


def _only(item: dict, fields: set[str], where: str) -> None:
    """A 400 naming the first field of `item` outside `fields`: refused, never dropped."""
    unknown = sorted(set(item) - fields)
    if unknown:
        name = f"{where}.{unknown[0][:40]}"
        raise APIError(400, f"{name}: not a field this server reads here", param=name)


def _text_of(content, where: str, field: str = "content") -> str:
    """A message's content (a string, or a list of text parts) as one string, or a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.{field}: a string or a list of input_text parts",
                       param=f"{where}.{field}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.{field}.{j}: {kind!r} content is not supported (text only)",
                           param=f"{where}.{field}")
        _only(part, {"type", "text", "annotations", "logprobs"}, f"{where}.{field}.{j}")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise APIError(400, f"{where}.{field}.{j}.text: a string", param=f"{where}.{field}")
        parts.append(text)
    return "".join(parts)


def _required_string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}.{name}: a non-empty string is required", param=f"{where}.{name}")
    return value


def _messages(req: ResponsesRequest, origins: Origins) -> list[dict]:
    """`instructions` and `input` as chat messages (consecutive function calls: one assistant turn),
    each one's place in `req` noted in `origins`."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    origins.messages += [("instructions", "system")] * len(messages)
    if isinstance(req.input, str):
        origins.messages.append(("input", "user"))
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise APIError(400, "input: an empty list (send a string or at least one item)", param="input")
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: an input item is an object", param=where)
        kind = item.get("type", "message")
        if kind in _ITEM_FIELDS:
            _only(item, _ITEM_FIELDS[kind], where)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role: {role!r} is not a message role", param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
            origins.messages.append((where, role))
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            if not isinstance(arguments, str):
                raise APIError(400, f"{where}.arguments: a string (JSON text)", param=f"{where}.arguments")
            call = {"id": _required_string(item, "call_id", where), "type": "function",
                    "function": {"name": _required_string(item, "name", where), "arguments": arguments}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.messages.append((where, "assistant"))
            origins.calls[(len(messages) - 1, len(messages[-1]["tool_calls"]) - 1)] = where
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _required_string(item, "call_id", where),
                             "content": _text_of(item.get("output"), where, "output")})
            origins.messages.append((where, "tool"))
        else:
            raise APIError(400, f"{where}.type: {kind!r} input items are not supported (messages, "
                           "function_call and function_call_output are)", param=f"{where}.type")
    return messages


def _tool(tool, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(400, f"tools.{i}.type: {kind!r} tools are not supported (function tools are)",
                       param=f"tools.{i}.type")
    _only(tool, {"type", "name", "description", "parameters", "strict"}, f"tools.{i}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


# ---- the reply ------------------------------------------------------------------------------


def _message_item(item_id: str, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": status}


def _response(rid: str, req: ResponsesRequest, state: ServerState, status: str, output: list, job=None,
              finish: str | None = None) -> dict:
    usage = None
    if job is not None:
        u = job.usage()
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        usage = {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                 "total_tokens": u.total_tokens, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens_details": {"reasoning_tokens": 0}}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": int(time.time()), "model": state.model_name,
            "status": status, "output": output, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "metadata": (req.model_extra or {}).get("metadata") or {},
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "usage": usage,
            "store": False, "truncation": "disabled"}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


async def respond(state: ServerState, req: ResponsesRequest, request) -> dict:
    from quantserve.server import serving_chat

    job, plan = await prepare_stream(state, req)
    await run_to_reply(job, request, collect(state, job))
    choice = job.choices[0]
    message, finish = serving_chat.reply_message(choice.text, choice.finish_reason, plan)
    output = []
    if message.content or not message.tool_calls:  # a reply of no text is still a message (empty)
        output.append(_message_item(new_id("msg"), message.content or "", _status(finish)))
    output += [_call_item(call) for call in message.tool_calls or []]
    return _response(new_id("resp"), req, state, _status(finish), output, job, finish)


async def prepare_stream(state: ServerState, req: ResponsesRequest):
    """The chat completion's job and tool plan for `req`; its 400s in the Responses request's terms."""
    from quantserve.server import serving_chat

    chat, origins = to_chat(req)
    try:
        return await serving_chat.prepare(state, chat)
    except APIError as e:
        raise origins.rename(e) from None


async def stream(state: ServerState, req: ResponsesRequest, job, plan) -> AsyncIterator[str]:
    from quantserve.server.serving import api_error_of
    from quantserve.server.serving_chat import ToolCallStream

    rid, mid, seq = new_id("resp"), new_id("msg"), iter(range(1 << 62))
    calls = ToolCallStream(plan) if plan is not None and plan.parses else None
    text, opened, output = "", False, []

    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

    def open_message() -> list[str]:
        return [event("response.output_item.added", output_index=0, item=_message_item(mid, "", "in_progress")),
                event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})]

    try:
        yield event("response.created", response=_response(rid, req, state, "in_progress", []))
        yield event("response.in_progress", response=_response(rid, req, state, "in_progress", []))
        async for _, delta in run_job(state, job):
            if delta.finish_reason == "error":
                e = api_error_of(job.choices[0].error)
                yield event("error", code=e.code, message=e.message, param=None)
                failed = _response(rid, req, state, "failed", output, job)
                failed["error"] = {"code": e.code or "server_error", "message": e.message}
                yield event("response.failed", response=failed)
                job.settle("error")
                return
            piece = calls.push(delta.text) if calls is not None else delta.text
            tool_deltas, finish = [], delta.finish_reason
            if delta.finish_reason and calls is not None:
                rest, tool_deltas, finish = calls.finish(delta.finish_reason)
                piece += rest
            if piece:
                if not opened:
                    opened = True
                    for e in open_message():
                        yield e
                text += piece
                yield event("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                            delta=piece, logprobs=[])
            if delta.finish_reason:
                if not opened and not tool_deltas:  # no text and no call: an empty message, as respond() gives
                    opened = True
                    for e in open_message():
                        yield e
                if opened:
                    item = _message_item(mid, text, _status(finish))  # cut by max_output_tokens: incomplete
                    yield event("response.output_text.done", item_id=mid, output_index=0, content_index=0,
                                text=text, logprobs=[])
                    yield event("response.content_part.done", item_id=mid, output_index=0, content_index=0,
                                part=item["content"][0])
                    yield event("response.output_item.done", output_index=0, item=item)
                    output.append(item)
                for d in tool_deltas:
                    index = len(output)
                    item = {"type": "function_call", "id": new_id("fc"), "call_id": d.id,
                            "name": d.function.name, "arguments": "", "status": "in_progress"}
                    yield event("response.output_item.added", output_index=index, item=item)
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=d.function.arguments)
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=d.function.arguments, name=d.function.name)
                    item = {**item, "arguments": d.function.arguments, "status": "completed"}
                    yield event("response.output_item.done", output_index=index, item=item)
                    output.append(item)
                status = _status(finish)
                yield event(f"response.{status}", response=_response(rid, req, state, status, output, job, finish))
        job.settle("success")
    except Exception:
        job.settle("error")
        raise
    finally:
        job.cancel()
