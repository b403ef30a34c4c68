"""Tool-call formats: how a model writes a function call, read back and written as a grammar.

Each model family was trained to write its calls one way; the server must read that way back into
OpenAI's `message.tool_calls`, and, when a call is required (`tool_choice` "required" or a named
function), constrain the output to it so that it always parses.  One `ToolCallFormat` per family:

- `hermes` (Hermes 2 Pro, Qwen2/2.5/3, and this server's fallback for templates without tools):
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call;
- `llama3_json` (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`, calls
  separated by `; `, after an optional `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` followed by a JSON list of `{"name": ..., "arguments": {...}}`.

A format is chosen by `--tool-call-parser`, or else guessed from the chat template's text
(`detect`).  Nothing here knows HTTP: a reply that does not parse is plain content, as in vLLM.

A marker may be one special token of the model's tokenizer (Mistral's `[TOOL_CALLS]`, Hermes 2
Pro's `<tool_call>`).  Special tokens are left out of the reply's text, so `for_tokenizer` binds
the format to those ids: its grammars name the token itself (`<[id]>` in llguidance's Lark, a
text literal would never match it), and the reply's text keeps the marker (`kept_tokens`), as
vLLM's parsers keep special tokens for requests with tools.
"""

from __future__ import annotations

import dataclasses
import json
import re
import weakref
from dataclasses import dataclass
from typing import Callable

# JSON inside a tool call is written compactly (see structured.JSON_STYLE: a small model given
# flexible whitespace can write newlines until max_tokens).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments` (a string)


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # the text a call begins with: streaming holds text back from here on
    args_key: str  # the key holding the arguments in one call's JSON
    parse: Callable[[str], tuple[str, list[ParsedCall]]]  # reply -> (content before the calls, calls)
    block: Callable[[str], str]  # one call's JSON -> its text in the reply (history)
    # (this format, one call's lark rule body, several allowed) -> lark grammar
    grammar: Callable[["ToolCallFormat", str, bool], str]
    # the same for tool_choice "auto" with strict tools: free text, or calls that must validate
    free_grammar: Callable[["ToolCallFormat", str, bool], str]
    markers: tuple[str, ...] = ()  # the texts around calls that a tokenizer may have as special tokens
    special: tuple[tuple[str, int], ...] = ()  # (marker, token id) where it is one special token

    def lark(self, marker: str) -> str:
        """The marker in a Lark grammar: its special token where it is one, else its text."""
        token = dict(self.special).get(marker)
        return f"<[{token}]>" if token is not None else _lark_string(marker)

    def kept_tokens(self) -> dict[int, str]:
        """Special token id -> its text, for the markers a reply's text must keep to parse."""
        return {token: marker for marker, token in self.special}

    def call_text(self, name: str, arguments: dict) -> str:
        """One call as the model writes it (assistant turns in the history, when the template
        has no tool support of its own)."""
        return self.block(json.dumps({"name": name, self.args_key: arguments}))


def _call_of(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args))


# ---- hermes -----------------------------------------------------------------------------------

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str, list[ParsedCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES_BLOCK.findall(text):
        try:
            call = _call_of(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []  # one bad block: the reply stays text, nothing half-parsed
        calls.append(call)
    if not calls:
        return text, []
    return text[:text.index("<tool_call>")].strip(), calls


# ---- llama3_json ------------------------------------------------------------------------------


def _parse_llama3(text: str) -> tuple[str, list[ParsedCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(obj, "parameters") or _call_of(obj, "arguments")
        if call is None:
            return text, []
        calls.append(call)
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, []
        at = len(body) - len(rest[1:].lstrip())
    return "", calls


# ---- mistral ----------------------------------------------------------------------------------


def _parse_mistral(text: str) -> tuple[str, list[ParsedCall]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    head, _, tail = text.partition("[TOOL_CALLS]")
    try:
        items, _ = json.JSONDecoder().raw_decode(tail.strip())
    except json.JSONDecodeError:
        return text, []
    items = items if isinstance(items, list) else [items]
    calls = [_call_of(i, "arguments") for i in items]
    if not calls or None in calls:
        return text, []
    return head.strip(), calls


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def _hermes_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    nl = _lark_string("\n")
    repeat = f" ({nl} block)*" if many else ""
    return (f"start: block{repeat}\n"
            f"block: {fmt.lark('<tool_call>')} {nl} call {nl} {fmt.lark('</tool_call>')}\n"
            f"call: {call}\n")


def _llama3_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    repeat = ' ("; " call)*' if many else ""
    return f"start: call{repeat}\ncall: {call}\n"


def _mistral_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    repeat = ' (", " call)*' if many else ""
    return f'start: {fmt.lark("[TOOL_CALLS]")} "[" call{repeat} "]"\ncall: {call}\n'


# Free text beside calls ("auto" with strict tools): a terminal of any text without the format's
# call marker, and a lazy one that ends at the marker, so the first marker the model writes starts
# a call that must validate (llguidance's `&` / `~` terminal operators and lazy lexemes).
def _text_without(marker: str) -> str:
    return f"/(?s:.*)/ & ~/(?s:.*){re.escape(marker)}(?s:.*)/"


def _head(fmt: ToolCallFormat, marker: str) -> str:
    """The rule `head`: free text up to and including the marker that starts a call.  A text marker
    ends a lazy lexeme; a special token follows text (which cannot hold it) as a token of its own."""
    if dict(fmt.special).get(marker) is not None:
        return f"head: TEXT {fmt.lark(marker)}\n"
    return f"head[lazy]: /(?s:.*){re.escape(marker)}/\n"


def _hermes_free_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    blocks = "block+" if many else "block"
    nl = _lark_string("\n")
    return (f"start: TEXT | {blocks} TEXT\n"  # after the calls, text without another marker
            f"TEXT: {_text_without('<tool_call>')}\n"
            + _head(fmt, "<tool_call>") +
            f"block: head {nl} call {nl} {fmt.lark('</tool_call>')}\n"
            f"call: {call}\n")


def _llama3_free_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    repeat = ' ("; " call)*' if many else ""
    return (f"start: TEXT | WS? call{repeat}\n"
            "TEXT: /(?s:.*)/ & ~/\\s*\\{(?s:.*)/\n"  # text that does not open a JSON object
            "WS: /\\s+/\n"
            f"call: {call}\n")


def _mistral_free_grammar(fmt: ToolCallFormat, call: str, many: bool) -> str:
    repeat = ' (", " call)*' if many else ""
    return (f'start: TEXT | head WS? "[" call{repeat} "]" TEXT\n'
            f"TEXT: {_text_without('[TOOL_CALLS]')}\n"
            "WS: /\\s+/\n"
            + _head(fmt, "[TOOL_CALLS]") +
            f"call: {call}\n")


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "arguments", _parse_hermes,
                             block=lambda call: f"<tool_call>\n{call}\n</tool_call>", grammar=_hermes_grammar,
                             free_grammar=_hermes_free_grammar, markers=("<tool_call>", "</tool_call>")),
    "llama3_json": ToolCallFormat("llama3_json", "{", "parameters", _parse_llama3,
                                  block=lambda call: call, grammar=_llama3_grammar, free_grammar=_llama3_free_grammar),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "arguments", _parse_mistral,
                              block=lambda call: f"[TOOL_CALLS][{call}]", grammar=_mistral_grammar,
                              free_grammar=_mistral_free_grammar, markers=("[TOOL_CALLS]",)),
}


_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {format name: bound format}


def for_tokenizer(fmt: ToolCallFormat, tokenizer) -> ToolCallFormat:
    """`fmt` with the markers this tokenizer has as one special token each: a token whose text
    the decoded reply leaves out (`decode` skips special tokens, `token_text` does not).  Kept
    beside the tokenizer, never keeping it (and the model a GGUF tokenizer holds) alive."""
    bound = _BOUND.setdefault(tokenizer, {})
    if fmt.name not in bound:
        bound[fmt.name] = _bind(fmt, tokenizer)
    return bound[fmt.name]


def _bind(fmt: ToolCallFormat, tokenizer) -> ToolCallFormat:
    special = []
    for marker in fmt.markers:
        try:
            ids = tokenizer.encode(marker, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the marker stays text
            continue
        if len(ids) == 1 and tokenizer.token_text(ids[0]) == marker and tokenizer.decode(ids) == "":
            special.append((marker, ids[0]))
    return dataclasses.replace(fmt, special=tuple(special)) if special else fmt


def detect(template: str | None) -> ToolCallFormat:
    """The format a chat template's text shows, else hermes (the fallback rendering's own)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return FORMATS["mistral"]
    if "<|python_tag|>" in text or "ipython" in text:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def call_schema(fmt: ToolCallFormat, name: str, parameters: dict) -> dict:
    """The JSON schema of one call of function `name` in this format."""
    return {"type": "object",
            "properties": {"name": {"const": name}, fmt.args_key: parameters},
            "required": ["name", fmt.args_key], "additionalProperties": False}


def _rebased(schema, base: str):
    """`schema` with its document-local refs ("#", "#/$defs/x") pointing under `base`: a function's
    parameters are nested inside the call's schema, where "#" would mean the call itself."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema (a property may be called "enum")
            out[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples"):  # instances, not schemas
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def call_grammar(fmt: ToolCallFormat, functions: dict[str, dict], many: bool, free_text: bool = False,
                 answer_schema: str | None = None) -> str:
    """A Lark grammar (llguidance's dialect, JSON schemas inline with `%json`) for one call, or
    several when `many`, of any of `functions` (name -> parameters schema); with `free_text`, the
    reply may be text instead (tool_choice "auto"), or with `answer_schema` (a JSON schema's text)
    a JSON answer of that schema."""
    options, defs = [], {}
    for i, (name, params) in enumerate(functions.items()):
        rebased = _rebased(params, f"#/$defs/call{i}")
        if rebased != params:  # it has local refs, which resolve from the grammar's root: it moves there
            defs[f"call{i}"], params = rebased, {"$ref": f"#/$defs/call{i}"}
        options.append(call_schema(fmt, name, params))
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    if defs:
        schema = {**schema, "$defs": defs}
    rule = "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})
    if not free_text:
        return fmt.grammar(fmt, rule, many)
    if answer_schema is None:
        return fmt.free_grammar(fmt, rule, many)
    # The answer is the format's JSON, or the reply is calls as a required choice writes them (no
    # text before them: a lazy "text up to the marker" lexeme beside the JSON's would leave the
    # parser two ways to read a reply's first bytes, and it takes one)
    answer = json.loads(answer_schema)
    answer = answer if isinstance(answer, dict) else {}  # the schema `true`: any JSON
    calls = fmt.grammar(fmt, rule, many).replace("start:", "calls:", 1)
    return f"start: answer | calls\nanswer: %json {json.dumps({**answer, 'x-guidance': _JSON_STYLE})}\n{calls}"
