"""The default corpus's tool skill: a calculator the model calls, written as the server writes it.

The one tool is what LangChain's `@tool` makes of `def add(a: int, b: int) -> int` documented
"Add two integers." (the shape agent frameworks send).  The default chat template has no tool
support of its own, so the server writes tools into the prompt itself (server/tools.py,
`render_fallback`): the listing in a system message, calls in the format it guesses from the
template (`tool_parsers.detect`: Hermes' `<tool_call>` JSON), results as `<tool_response>` user
turns.  The corpus's exchanges are rendered by that same code, so what the model learns and what
the server sends cannot drift apart.

One exchange: the listing, the question ("What is 17 + 25?"), the call
(`{"name": "add", "arguments": {"a": 17, "b": 25}}`), the tool's result (42) and the reply (42).
The numbers are written as the question writes them (" 17" is one token in both), so the call
copies tokens out of the prompt, and the reply copies the result's.
"""

from __future__ import annotations

import json

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "type": "object"}}}


def call_format():
    """The tool-call format the server reads from the default model (guessed from its template)."""
    from quantserve.demo.tokenizer import CHAT_TEMPLATE
    from quantserve.server.tool_parsers import detect

    return detect(CHAT_TEMPLATE)


def call_text(arguments: dict) -> str:
    """A call of `add` as the model writes it."""
    return call_format().call_text(ADD_TOOL["function"]["name"], arguments)


def expected_call(answer: str) -> tuple[str, dict]:
    """The function name and arguments that a reference answer calls."""
    _, calls = call_format().parse(answer)
    (call,) = calls
    return call.name, json.loads(call.arguments)


def run(name: str, arguments: dict) -> str:
    """The tool itself: what a client answers the call with."""
    if name != ADD_TOOL["function"]["name"]:
        raise ValueError(f"no tool {name!r}")
    return str(arguments["a"] + arguments["b"])


def around(prompt: str, answer: str) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """The messages before the user's `prompt` (the tools' listing) and after the call `answer`
    (the tool's result, and the reply that repeats it), as the server renders such a request."""
    from quantserve.server.tools import history_call, plan, render_fallback

    name, args = expected_call(answer)
    result = run(name, args)
    call = history_call({"id": "call_0", "type": "function",
                         "function": {"name": name, "arguments": json.dumps(args)}}, "call")
    history = [{"role": "user", "content": prompt},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": result, "tool_call_id": "call_0"}]
    fmt = call_format()
    system, user, assistant, tool_result = render_fallback(history, plan([ADD_TOOL], "auto", None, fmt), fmt)
    assert user["content"] == prompt and assistant["content"] == answer, (user, assistant)
    return (system,), (tool_result, {"role": "assistant", "content": result})
