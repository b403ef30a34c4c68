"""No request field is dropped without a word: each one is implemented, harmless, or refused by name.

A client that sends a field this server does not honour (a tool, an audio modality, beam search)
and gets a normal-looking reply has been lied to; it gets a 400 naming the field instead.  The
request models keep every field they do not declare (`extra="allow"`), so the tables below see
them all:

- `HINTS`: fields of OpenAI's schema that do not change what is generated (who is asking, cache
  and routing hints, tags for stored completions): accepted as they are;
- `OFF_VALUES`: fields this server does not implement, accepted only at their "off" values (what
  the official client or vLLM sends by default), refused otherwise;
- anything else is unknown to OpenAI's API and to this server's extras: refused.

tests/serve/test_unsupported.py walks the `openai` package's own request schemas, so a field that the
SDK learns later is caught as unknown here until someone decides which table it belongs to.
"""

from __future__ import annotations

from quantserve.server.errors import APIError

HINTS = {"user", "safety_identifier", "prompt_cache_key", "metadata", "request_id"}

_NOT_YET = "is not supported by this server"
# field -> (values that mean "off", why it is refused otherwise)
OFF_VALUES: dict[str, tuple[tuple, str]] = {
    # OpenAI chat
    # on completions (chat declares these): tools are a chat feature
    "tools": ((None, []), "tools are served on /v1/chat/completions, not on /v1/completions"),
    "tool_choice": ((None, "none", "auto"), "tools are served on /v1/chat/completions, not on /v1/completions"),
    "parallel_tool_calls": ((None, True, False), ""),  # only means something with tools
    # the deprecated spelling of tools (2023): use tools and tool_choice
    "functions": ((None, []), "the deprecated functions field " + _NOT_YET + ": use tools"),
    "function_call": ((None, "none", "auto"), "the deprecated function_call field " + _NOT_YET + ": use tool_choice"),
    "audio": ((None,), "audio output " + _NOT_YET),
    "modalities": ((None, ["text"]), "only the text modality is served"),
    "prediction": ((None,), "predicted outputs " + _NOT_YET),
    "reasoning_effort": ((None,), "this model has no reasoning mode: reasoning_effort cannot be honoured"),
    "verbosity": ((None,), "verbosity cannot be honoured by this server"),
    "web_search_options": ((None,), "web search " + _NOT_YET),
    "moderation": ((None,), "moderation " + _NOT_YET),
    "store": ((None, False), "completions are not stored by this server"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "prompt_cache_retention": ((None,), "prompt cache retention cannot be set on this server"),
    "prompt_cache_options": ((None,), "prompt cache options cannot be set on this server"),
    # OpenAI completions
    "suffix": ((None, ""), "suffix (fill-in-the-middle) " + _NOT_YET),
    # vLLM's extras
    "best_of": ((None, 1), "best_of " + _NOT_YET + " on chat completions"),
    "use_beam_search": ((None, False), "beam search " + _NOT_YET),
    "length_penalty": ((None, 1.0), "length_penalty applies to beam search, which " + _NOT_YET),
    "min_tokens": ((None, 0), "min_tokens " + _NOT_YET),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the output text"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens cannot be changed here"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output " + _NOT_YET),
    "prompt_logprobs": ((None,), "prompt_logprobs " + _NOT_YET),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids " + _NOT_YET),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated here: a long one gets a 400"),
    "allowed_token_ids": ((None,), "allowed_token_ids " + _NOT_YET + " (use logit_bias or structured_outputs)"),
    "bad_words": ((None, []), "bad_words " + _NOT_YET),
    "logits_processors": ((None,), "custom logits processors " + _NOT_YET),
    "guided_decoding_backend": ((None,), "the structured-output backend is fixed (llguidance)"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern " + _NOT_YET),
    "priority": ((None, 0), "request priorities " + _NOT_YET),
    "add_generation_prompt": ((None, True), "the generation prompt is always added"),
    "continue_final_message": ((None, False), "continue_final_message " + _NOT_YET),
    "add_special_tokens": ((None, False), "add_special_tokens " + _NOT_YET + " for chat (the template adds them)"),
    "chat_template": ((None,), "a per-request chat template " + _NOT_YET),
    "documents": ((None,), "documents " + _NOT_YET),
    "mm_processor_kwargs": ((None,), "this server serves text models only"),
    "cache_salt": ((None,), "cache_salt " + _NOT_YET),
    "kv_transfer_params": ((None,), "KV transfer " + _NOT_YET),
    "vllm_xargs": ((None,), "vllm_xargs " + _NOT_YET),
}
# chat: `echo` is a vLLM extra (the last message repeated), unlike completions' echo
CHAT_ONLY_OFF = {"echo": ((None, False), "echo " + _NOT_YET + " on chat completions")}
MESSAGE_OFF = {"function_call": ((None,), "the deprecated function_call " + _NOT_YET + ": use tool_calls"),
               "refusal": ((None,), "assistant refusals in the conversation " + _NOT_YET),
               "audio": ((None,), "audio " + _NOT_YET)}


def refuse_fields(extras: dict, table: dict, hints: set, api: str = "OpenAI's API") -> None:
    """A 400 for the first field of `extras` (what the request model did not declare) that is not
    a hint and not at one of its "off" values in `table`; unknown fields are refused too."""
    for name, value in extras.items():
        if name in hints:
            continue
        if name not in table:
            raise APIError(400, f"unknown field {name!r}: not part of {api} nor of this server's extras",
                           param=name)
        off, why = table[name]
        if value not in off:
            raise APIError(400, f"{name}: {why}", param=name)


def refuse_unsupported(req, chat: bool) -> None:
    """Raise a 400 naming the first field of `req` that this server would otherwise ignore."""
    refuse_fields(dict(req.model_extra or {}), {**OFF_VALUES, **(CHAT_ONLY_OFF if chat else {})}, HINTS)
    if getattr(req, "best_of", None) not in (None, req.n):
        raise APIError(400, "best_of other than n is not supported by this server (no server-side "
                       "selection of the best choices)", param="best_of")
    refuse_message_fields(getattr(req, "messages", None) or [])


def refuse_message_fields(messages) -> None:
    """A 400 for the first chat message with a field this server would ignore, or that is
    incomplete for its role, or a tool result that answers no call (as OpenAI's API refuses it)."""
    calls: list = []  # the tool calls of the latest assistant message that made some
    for i, message in enumerate(messages):
        for name, value in (message.model_extra or {}).items():
            param = f"messages.{i}.{name}"
            if name not in MESSAGE_OFF:
                raise APIError(400, f"{param}: unknown message field", param=param)
            off, why = MESSAGE_OFF[name]
            if value not in off:
                raise APIError(400, f"{param}: {why}", param=param)
        if message.content is None and message.role != "assistant":
            raise APIError(400, f"messages.{i}: a {message.role} message needs 'content'",
                           param=f"messages.{i}.content")
        if message.content is None and not message.tool_calls:
            raise APIError(400, f"messages.{i}: an assistant message needs 'content' or 'tool_calls'",
                           param=f"messages.{i}.content")
        if message.tool_calls and message.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                           param=f"messages.{i}.tool_calls")
        if message.role == "tool" and not message.tool_call_id:
            raise APIError(400, f"messages.{i}: a tool message needs 'tool_call_id' (the call it answers)",
                           param=f"messages.{i}.tool_call_id")
        if message.tool_call_id is not None and message.role != "tool":
            raise APIError(400, f"messages.{i}.tool_call_id: only tool messages answer a call",
                           param=f"messages.{i}.tool_call_id")
        if message.tool_calls:
            calls = message.tool_calls
        ids = {c.get("id") for c in calls if isinstance(c, dict)}
        if message.role == "tool" and message.tool_call_id not in ids and not (calls and None in ids):
            # (a call sent back without its id, which tools.history_call takes, cannot be matched)
            why = "a tool result answers a call, and no call was made before it" if not calls else \
                f"{message.tool_call_id[:40]!r} is the id of none of the calls the last turn with calls made"
            raise APIError(400, f"messages.{i}.tool_call_id: {why}", param=f"messages.{i}.tool_call_id")
