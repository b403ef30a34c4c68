"""Tool calling on `/v1/chat/completions`: `tools`, `tool_choice`, `parallel_tool_calls`, and
tool calls and results in the conversation.

- The tools are checked (names, parameters schemas, duplicates) and rendered into the prompt: by
  the chat template itself when it knows tools (its source mentions `tools`: passed as
  `apply_chat_template(tools=...)`), otherwise by the fallback below, which writes them into the
  system message in the Hermes format (`<tools>` ... `</tools>`, calls as `<tool_call>` JSON:
  Qwen2.5's own wording), and writes earlier calls and results as text the same way.
- `tool_choice` "auto" lets the model choose; the reply is parsed with the model's format
  (`tool_parsers.py`).  "required" and a named function constrain the reply with a grammar built
  from the functions' parameter schemas, so the call always parses and its arguments validate;
  so does "auto" when a tool is `strict` (OpenAI's promise), where text stays free until the
  format's call marker and the call after it must validate.
  "none" renders the tools but reads the reply as text (vLLM's default).

Errors are `ToolError`s naming the request field; the API layer answers 400.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from quantserve.server.exceptions import RequestFieldError
from quantserve.server.tool_parsers import ToolCallFormat, call_grammar

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class ToolError(RequestFieldError):
    """Tools or tool messages that cannot be used as sent; `param` names the request field."""


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt and its reply."""

    tools: list[dict]  # OpenAI's tool objects, checked: [{"type": "function", "function": {...}}]
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None  # the function `tool_choice` names
    parallel: bool
    fmt: ToolCallFormat

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    @property
    def strict(self) -> bool:
        """"auto" with a tool marked strict: the reply may be text, but a call must validate."""
        return self.choice == "auto" and any(t["function"].get("strict") for t in self.tools)

    def grammar(self, answer_schema: str | None = None) -> str | None:
        """The Lark grammar a required, named or strict choice constrains the reply to; else None.
        `answer_schema`: under a strict "auto", the JSON schema a reply that is not a call follows
        (the request's response format), else free text."""
        if self.choice not in ("required", "named") and not self.strict:
            return None
        from quantserve.server.structured import MAX_FORMAT_BYTES

        functions = self.functions
        if self.named:
            functions = {self.named: functions[self.named]}
        grammar = call_grammar(self.fmt, functions, many=self.parallel and not self.named, free_text=self.strict,
                               answer_schema=answer_schema)
        if len(grammar.encode()) > MAX_FORMAT_BYTES:  # compiled while the request waits: bounded
            raise ToolError(f"the tools' parameter schemas are {len(grammar.encode()):,} bytes as a grammar; a "
                            f"constrained call takes at most {MAX_FORMAT_BYTES:,}", "tools")
        return grammar


def plan(tools, tool_choice, parallel_tool_calls, fmt: ToolCallFormat) -> ToolPlan | None:
    """The request's tool plan, checked; None when it has no tools."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"at most {MAX_TOOLS} tools (got {len(tools)})", "tools")
    names: set[str] = set()
    checked = []
    for i, tool in enumerate(tools):
        checked.append(_check_tool(tool, f"tools.{i}"))
        name = checked[-1]["function"]["name"]
        if name in names:
            raise ToolError(f"tools.{i}: duplicate function name {name!r}", "tools")
        names.add(name)
    choice, named = _choice(tool_choice, names)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    return ToolPlan(checked, choice, named, parallel, fmt)


def _check_tool(tool, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f"{param}: a tool is {{\"type\": \"function\", \"function\": {{...}}}} (only function tools are served)", "tools")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise ToolError(f"{param}.{unknown[0]}: unknown field", "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{param}.function must be an object", "tools")
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise ToolError(f"{param}.function.{unknown[0]}: unknown field", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"{param}.function.name must be 1-64 letters, digits, '_' or '-' (got {str(name)[:70]!r})", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"{param}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
        raise ToolError(f"{param}.function.parameters must be a JSON schema of an object", "tools")
    if params is not None:
        error = _schema_error(json.dumps(params, sort_keys=True))
        if error:
            raise ToolError(f"{param}.function.parameters: {error.splitlines()[0][:300]}", "tools")
    if not isinstance(fn.get("strict", False), (bool, type(None))):
        raise ToolError(f"{param}.function.strict must be true or false", "tools")
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


@functools.lru_cache(maxsize=256)  # an agent sends the same tools on every turn
def _schema_error(schema: str) -> str:
    """llguidance's complaint about a parameters schema (JSON text), '' when none.  Lenient: a
    malformed schema is the caller's mistake whatever tool_choice says, but keywords a grammar
    cannot enforce (uniqueItems, not, ...) only matter where one is built from it (required,
    named, strict), which reports them then."""
    import llguidance

    lenient = json.dumps({**json.loads(schema), "x-guidance": {"lenient": True}})
    return llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(lenient))


def _choice(tool_choice, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or set(tool_choice) != {"type", "function"} or set(fn) != {"name"}:
            raise ToolError("tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in names:
            raise ToolError(f"tool_choice names {name[:70]!r}, which is not among the tools", "tool_choice")
        return "named", name
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}", "tool_choice")


# ---- the conversation ---------------------------------------------------------------------------


def history_call(call, param: str) -> dict:
    """An assistant message's `tool_calls` item, checked, with its arguments parsed: templates
    write `arguments` with `tojson`, so they get the object, not OpenAI's JSON string."""
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(call.get("function"), dict):
        raise ToolError(f"{param}: a tool call is {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", param)
    fn = call["function"]
    unknown = sorted(set(call) - {"id", "type", "function", "index"}) or sorted(set(fn) - {"name", "arguments"})
    if unknown:  # refused, not dropped (index: what a client that joined streamed deltas keeps)
        raise ToolError(f"{param}: {unknown[0][:40]!r} is not a field of a tool call", param)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"{param}.function.name must be a non-empty string", param)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise ToolError(f"{param}.function.arguments is not valid JSON", param) from None
    if not isinstance(args, dict):
        raise ToolError(f"{param}.function.arguments must be a JSON object", param)
    return {"id": str(call.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def render_fallback(messages: list[dict], plan_: ToolPlan | None, fmt: ToolCallFormat) -> list[dict]:
    """Messages for a template that knows no tools: the tools go into the system message, calls
    into the assistant's text, results into user turns (Qwen2.5's layout: every template can
    render these roles)."""
    out = [dict(m) for m in messages]
    if plan_ is not None:
        listing = "\n".join(json.dumps(t["function"], separators=(",", ":")) for t in plan_.tools)
        text = (f"# Tools\n<tools>\n{listing}\n</tools>\nTo call a function, reply with "
                f"{fmt.call_text('...', {})}".replace('{}', '{...}'))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    rendered = []
    for m in out:
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            blocks = "\n".join(fmt.call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        rendered.append(m)
    return rendered


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template
