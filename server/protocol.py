"""The OpenAI wire format's requests: pydantic models, fields in the OpenAI docs' order (the replies:
protocol_replies.py).

Requests accept the OpenAI fields plus the usual open-server extras (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, vLLM's `structured_outputs`), passed by the
official client through `extra_body`.  Fields of OpenAI's schema that this server does not
implement, and fields nobody defines, are kept (`extra="allow"`) so that `unsupported.py` can
refuse them by name: no field is dropped without a word.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from quantserve.server.sampling import SamplingParams

# Stop sequences: OpenAI allows 4, vLLM has no limit.  Each one is re-checked against the held-back
# tail of the text at every token, so their number and length bound per-token work; 64 of up to
# 256 characters is far beyond any real use (stop words, role markers) and keeps that work small.
MAX_STOPS = 64
MAX_STOP_CHARS = 256
# Token ids sent by clients: the exact vocabulary check happens once the model is known; this bound
# only keeps absurd integers (JSON has no limit) away from the tokenizer, which takes 32-bit ids.
MAX_TOKEN_ID = 2**31 - 1
# The seed names a 64-bit generator stream (negative seeds too); choice i uses seed + i.  vLLM's range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(data) -> str | None:
    """Where a string (or key) of the body holds a lone UTF-16 surrogate, else None.

    JSON may escape one (\\ud800) and Python's parser lets it through, but it is not a character:
    tokenizers refuse it and a reply quoting it cannot be encoded as UTF-8.  Walked with a stack,
    not recursion: a body nested as deep as the JSON parser allows must not overflow Python's stack.
    Locations are (parent, key) links, spelled out only for the one reported.
    """
    def spell(node) -> str:
        keys = []
        while node is not None:
            node, key = node
            keys.append(str(key))
        return ".".join(reversed(keys)) or "body"

    stack = [(None, data)]
    while stack:
        node, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return spell(node)
        elif isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"a key in {spell(node)}"
                stack.append(((node, k), v))
        elif isinstance(value, list):
            stack.extend(((node, i), v) for i, v in enumerate(value))
    return None


class _Request(BaseModel):
    """Base of every request body: refuses text that is not valid Unicode, wherever it is, and reads
    null as "the default" for fields that have one (OpenAI's schema marks them nullable, and clients
    that serialise None send it).  Types are strict, as OpenAI's API checks them: `true` is not a
    temperature of 1.0, "5" not a max_tokens, 1.0 not a token id."""

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = _lone_surrogate_at(data)
        if where:
            raise ValueError(f"{where[:80]}: text must be valid Unicode (found a lone surrogate escape \\ud800-\\udfff)")
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            defaulted = _defaulted_fields(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data


@functools.cache
def _defaulted_fields(model: type[BaseModel]) -> frozenset[str]:
    """A request model's fields whose default is not None (a null sent for them means that default)."""
    return frozenset(name for name, f in model.model_fields.items() if not f.is_required() and f.default is not None)


def _check_token_ids(ids: list[int]) -> None:
    if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")


def _checked_prompt(prompt):
    """A prompt (or embedding input): text, texts, token ids or lists of them; ids checked."""
    if isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, int):
                _check_token_ids(prompt)
                break
            if isinstance(item, list):
                _check_token_ids(item)
    return prompt


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # an option nobody honours is refused, not dropped

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    # OpenAI's random padding of stream events against length side channels: not done here
    include_obfuscation: Literal[False] = False


class _SamplingFields(_Request):
    # Python's JSON parser accepts NaN and Infinity (not JSON); every float here refuses them, so a
    # NaN never reaches the sampler (a comparison with NaN is always false and slips past ge/le).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None  # the served model when left out (as vLLM and llama-server take it)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    max_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (a JSON key) -> bias; checked in serving
    # structured output (structured.py): OpenAI's field, vLLM's, and vLLM's older spellings
    response_format: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    # extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None

    @field_validator("stream_options")  # a field's validator, so that the error names the field
    @classmethod
    def _stream_options_need_stream(cls, options, info: ValidationInfo):
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream true (as OpenAI's API)")
        return options

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, ids):
        _check_token_ids(ids or [])
        return ids

    def guided(self) -> dict:
        return {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}

    def to_sampling_params(self, max_tokens: int, choice_index: int = 0, **checked) -> SamplingParams:
        """The engine's sampling parameters for choice `choice_index` of this request.  What needs
        the engine to check (`logprobs` against the server's cap, `logit_bias` ids against the
        vocabulary, a compiled `constraint`, `max_tokens` against the context) comes in `checked`."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=None if self.seed is None else self.seed + choice_index,  # each choice its own stream
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, min_p=self.min_p,
            stop_token_ids=list(self.stop_token_ids or []), **checked)

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed (got {len(stops)})")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters long")
        if any(s == "" for s in stops):  # it would stop before the first token: refused, not dropped
            raise ValueError("a stop sequence may not be empty")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    best_of: Optional[int] = Field(None, ge=1)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0)

    @field_validator("prompt")
    @classmethod
    def _prompt_ids(cls, prompt):
        return _checked_prompt(prompt)


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # e.g. cache_control: refused, not dropped

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unsupported.refuse_unsupported names what is left over

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None  # an assistant's earlier calls; checked in tools.history_call
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: extra variables for the template
    # tool calling (tools.py): checked there, so that errors name the exact tool
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None


class EmbeddingRequest(_Request):
    model_config = ConfigDict(extra="allow")  # what is left over is refused by name (serving_embeddings)

    model: str | None = None  # the served model when left out (as vLLM and llama-server take it)
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None

    @field_validator("input")
    @classmethod
    def _input_ids(cls, value):
        return _checked_prompt(value)


class ResponsesRequest(_Request):
    """OpenAI's Responses API request (serving_responses.py turns it into a chat completion)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None  # the served model when left out (as vLLM and llama-server take it)
    input: Union[str, list[Any]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    # the open-server extras chat takes too, through the client's extra_body
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    ignore_eos: Optional[bool] = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize body; any other field is refused by name (never silently ignored)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # the served model when left out (as vLLM and llama-server take it)
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)  # as a chat completion's
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None  # the served model when left out (as vLLM and llama-server take it)
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _token_ids(cls, tokens):
        _check_token_ids(tokens)
        return tokens
