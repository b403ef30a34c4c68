"""Structured output: JSON schemas, JSON objects, regexes, choices and grammars as token masks.

A request's format is compiled once into an llguidance grammar (cached by its text), checked
against the model's tokenizer, and each choice gets its own matcher.  At every step the sampler
asks the matcher which tokens may come next and masks the rest to -inf before temperature, top-k
and top-p; the sampled token is fed back.  When the grammar is complete only end-of-sequence is
allowed, so the reply ends there.

llguidance is used, not xgrammar: it has a numpy API, and the gguf engine's process must stay
torch-free (next to llama.cpp's CUDA build, torch crashes the process).  Errors here know nothing
of HTTP: `GrammarError` carries the request field it is about, and the API layer answers 400.

Accepted spellings of a format (at most one per request):
- OpenAI `response_format`: {"type": "text" | "json_object"} or {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}; with strict true an object schema
  that leaves `additionalProperties` out gets it false (only the listed properties, as OpenAI's);
- vLLM `structured_outputs`: {"json": schema, "regex": str, "choice": [str], "grammar": str
  (Lark or GBNF), "json_object": true}, and its older top-level `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from quantserve.server.exceptions import RequestFieldError

# A schema or grammar is compiled while the request waits: bound what one request can ask for.
MAX_FORMAT_BYTES = 64 * 1024
CACHE_SIZE = 64
# JSON is written compactly, as json.dumps does: flexible whitespace lets a model that never saw
# JSON emit newlines until max_tokens (measured on the default model); a schema's own
# "x-guidance" options still override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


class GrammarError(RequestFieldError):
    """A format the request asked for cannot be used; `param` names the request field."""


@dataclass(frozen=True)
class OutputFormat:
    kind: str  # "json" | "regex" | "choice" | "grammar"
    text: str  # the schema as JSON, the regex, the choices as a JSON list, or the grammar
    param: str  # the request field it came from (for errors)


def output_format(response_format=None, structured_outputs=None, guided: dict | None = None) -> OutputFormat | None:
    """The one format a request asks for, from whichever spelling it used; None for free text."""
    found: list[OutputFormat] = []
    if response_format is not None:
        fmt = _from_response_format(response_format)
        if fmt:
            found.append(fmt)
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise GrammarError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(structured_outputs) - set(STRUCTURED_KEYS))
        if unknown:
            raise GrammarError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                               f"{', '.join(STRUCTURED_KEYS)})", "structured_outputs")
        for key, value in structured_outputs.items():
            if value is None or (key == "json_object" and value is False):  # vLLM's "off" values
                continue
            found.append(_from_key(key, value, f"structured_outputs.{key}"))
    for name, value in (guided or {}).items():
        if value is not None:
            found.append(_from_key(GUIDED_KEYS[name], value, name))
    if len(found) > 1:
        raise GrammarError(f"ask for one output format, not several ({', '.join(f.param for f in found)})",
                           found[1].param)
    return found[0] if found else None


def _from_response_format(fmt) -> OutputFormat | None:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise GrammarError("response_format must be an object with a 'type'", param)
    kind = fmt["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)", param)
    unknown = sorted(set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if unknown:  # e.g. a "schema" beside json_object: it would not be followed
        raise GrammarError(f"response_format.{unknown[0]} is not a field of a {kind!r} format", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json", '{"type": "object"}', param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise GrammarError("response_format json_schema needs a 'json_schema' object with a 'name'", param)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise GrammarError(f"response_format.json_schema.{unknown[0]} is not a known field", param)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise GrammarError("response_format.json_schema.strict must be true or false", param)
    schema = spec.get("schema", {})
    if spec.get("strict") and isinstance(schema, dict):
        schema = _closed(copy.deepcopy(schema))
    return _from_key("json", schema, param)


# the keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "contains",
              "propertyNames", "not", "if", "then", "else")
_SUBSCHEMAS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema):
    """OpenAI's strict mode: an object has only the properties its schema lists.  Every object
    schema that leaves `additionalProperties` out gets it false (JSON Schema's default, true, let a
    model add keys, and repeat them); one that sets it keeps its own.  Changes `schema` in place."""
    if not isinstance(schema, dict):
        return schema
    types = schema.get("type")
    is_object = "properties" in schema or types == "object" or (isinstance(types, list) and "object" in types)
    if is_object and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(schema):
        schema["additionalProperties"] = False
    for key in _SUBSCHEMA:
        for sub in schema.get(key) if isinstance(schema.get(key), list) else [schema.get(key)]:
            _closed(sub)
    for key in _SUBSCHEMAS:
        for sub in schema.get(key) if isinstance(schema.get(key), list) else []:
            _closed(sub)
    for key in _SCHEMA_MAPS:
        for sub in (schema.get(key) or {}).values() if isinstance(schema.get(key), dict) else []:
            _closed(sub)
    return schema


def _from_key(key: str, value, param: str) -> OutputFormat:
    if key == "json_object":
        if value is not True:
            raise GrammarError(f"{param} must be true", param)
        return OutputFormat("json", '{"type": "object"}', param)
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param}: the schema is not valid JSON ({e.msg})", param) from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError(f"{param}: a JSON schema is an object", param)
        return OutputFormat("json", _bounded(json.dumps(value), param), param)
    if key == "regex":
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{param} must be a non-empty string", param)
        return OutputFormat("regex", _bounded(value, param), param)
    if key == "choice":
        if (not isinstance(value, list) or not value or
                not all(isinstance(c, str) and c for c in value)):
            raise GrammarError(f"{param} must be a non-empty list of non-empty strings", param)
        return OutputFormat("choice", _bounded(json.dumps(value), param), param)
    if key == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise GrammarError(f"{param} must be a non-empty grammar (Lark or GBNF)", param)
        return OutputFormat("grammar", _bounded(value, param), param)
    raise GrammarError(f"unknown output format {key!r}", param)


def _bounded(text: str, param: str) -> str:
    if len(text.encode()) > MAX_FORMAT_BYTES:
        raise GrammarError(f"{param} is {len(text.encode()):,} bytes; at most {MAX_FORMAT_BYTES:,}", param)
    return text


class GrammarCompiler:
    """Compiles formats for one model's tokenizer; compiled matchers are cached by format."""

    def __init__(self, make_tokenizer):
        self._make_tokenizer = make_tokenizer  # () -> llguidance.LLTokenizer, built on first use (~1 s)
        self._tokenizer = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None  # llguidance's thread pool: a batch's masks computed in parallel

    def matcher(self, fmt: OutputFormat) -> "Constraint":
        """A fresh constraint for one choice, or GrammarError naming what is wrong."""
        with self._lock:
            template = self._cache.get((fmt.kind, fmt.text))
            if template is None:
                template = self._compile(fmt)
                self._cache[(fmt.kind, fmt.text)] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end((fmt.kind, fmt.text))
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            matcher, words = template
            return Constraint(matcher.deep_copy(), words, self._executor,
                              on_error=lambda: self._forget((fmt.kind, fmt.text), template))

    def _forget(self, key: tuple[str, str], template) -> None:
        """Drop a compiled format whose matcher failed: its copies share the lexer's state, so
        once one copy hits a lexer limit every later copy would start in error (allowing only
        end-of-sequence, an empty reply that looks like success)."""
        with self._lock:
            if self._cache.get(key) is template:
                del self._cache[key]

    def _compile(self, fmt: OutputFormat):
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        try:
            if fmt.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(fmt.text, defaults=JSON_STYLE)
            else:
                grammar = llguidance.grammar_from(fmt.kind, fmt.text)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{fmt.param}: {_first_line(e)}", fmt.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"{fmt.param}: cannot be compiled: {_first_line(error)}", fmt.param)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{fmt.param}: cannot be compiled: {_first_line(matcher.get_error())}", fmt.param)
        # One mask is ceil(vocab / 32) words: what the executor fills.  (`compute_bitmask` of
        # llguidance 1.9 returns a word more when the vocabulary is a multiple of 32: cut off.)
        return matcher, (self._tokenizer.vocab_size + 31) // 32


def _first_line(error) -> str:
    """The library's message on one line (its parse errors draw a caret diagram over several)."""
    return " ".join(str(error).split())[:300] or type(error).__name__


class Constraint:
    """One choice's grammar state: which tokens may come next, and the tokens it has taken."""

    def __init__(self, matcher, words: int, executor, on_error=None):
        self._matcher = matcher
        self.words = words  # int32 words in one bitmask
        self._executor = executor
        self._on_error = on_error  # called once the matcher is in error (the compiler drops its template)

    def bitmask(self):
        """The allowed next tokens as int32 words, bit i of word w = token 32 w + i (llguidance's
        layout: what `sampling.masked_argmax` unpacks where the logits are)."""
        import numpy as np

        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)[:self.words]
        self._raise_if_error()
        return words

    def mask(self, width: int):
        """A boolean array over `width` logits: True where the token is allowed next."""
        import numpy as np

        allowed = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little").astype(bool)
        if allowed.size >= width:
            return allowed[:width]
        return np.concatenate([allowed, np.zeros(width - allowed.size, dtype=bool)])

    def accept(self, token: int) -> None:
        self._raise_if_error()  # a mask computed in a batch (batch_bitmasks) may have failed
        if not self._matcher.consume_token(token):  # the mask allowed it: the grammar itself gave out
            self._raise_if_error(always=True)
        self._raise_if_error()

    def _raise_if_error(self, always: bool = False) -> None:
        """OutputFormatError if the matcher has failed (a lexer limit, or no way to go on).  An
        errored matcher allows only end-of-sequence, so without this the reply would end empty,
        finish_reason "stop", as if the format had been followed."""
        if not (always or self._matcher.is_error()):
            return
        from quantserve.server.exceptions import OutputFormatError

        if self._on_error is not None:
            self._on_error()
            self._on_error = None
        reason = (self._matcher.get_error() or "its parser stopped").strip().splitlines()[0]  # then a state dump
        raise OutputFormatError(f"the output format cannot be followed to an end (does its schema or grammar "
                                f"have a finite instance?): {reason}")

    @property
    def finished(self) -> bool:
        return self._matcher.is_stopped()


def batch_bitmasks(constraints: list[Constraint]):
    """[len(constraints), words] int32 bitmasks, computed by llguidance's threads in parallel (a
    decode step of 32 structured rows would otherwise compute 32 masks one after another)."""
    import numpy as np

    words = constraints[0].words
    out = np.empty((len(constraints), words), dtype=np.int32)
    if len(constraints) == 1:
        out[0] = constraints[0].bitmask()
        return out
    constraints[0]._executor.unsafe_compute_mask_ptr(
        [(c._matcher, i) for i, c in enumerate(constraints)], out.ctypes.data, words * 4, len(constraints))
    return out
