"""Every field of OpenAI's request schemas is implemented here or refused by name: none dropped.

The schemas are the `openai` package's own request types, so a field that the SDK learns in a
later release fails this test until it is placed: implemented (declared on the request model),
a harmless hint, or refused unless off (server/unsupported.py).
"""

from __future__ import annotations

import typing

import pytest

from quantserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from quantserve.server.unsupported import CHAT_ONLY_OFF, HINTS, MESSAGE_OFF, OFF_VALUES


def openai_fields(typed_dict) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def placed(model, chat: bool) -> set[str]:
    return set(model.model_fields) | HINTS | set(OFF_VALUES) | (set(CHAT_ONLY_OFF) if chat else set())


@pytest.mark.parametrize("module, model, chat", [
    ("openai.types.chat.completion_create_params", ChatCompletionRequest, True),
    ("openai.types.completion_create_params", CompletionRequest, False),
])
def test_every_openai_request_field_is_placed(module, model, chat):
    import importlib

    params = importlib.import_module(module)
    fields = openai_fields(params.CompletionCreateParamsBase) | {"stream"}
    missing = sorted(fields - placed(model, chat))
    assert not missing, f"OpenAI fields neither implemented nor refused: {missing}"


def test_every_openai_message_field_is_placed():
    from openai.types.chat import (ChatCompletionAssistantMessageParam, ChatCompletionDeveloperMessageParam,
                                   ChatCompletionSystemMessageParam, ChatCompletionToolMessageParam,
                                   ChatCompletionUserMessageParam)

    fields = set().union(*(openai_fields(t) for t in (
        ChatCompletionAssistantMessageParam, ChatCompletionDeveloperMessageParam, ChatCompletionSystemMessageParam,
        ChatCompletionToolMessageParam, ChatCompletionUserMessageParam)))
    missing = sorted(fields - set(ChatMessage.model_fields) - set(MESSAGE_OFF))
    assert not missing, f"OpenAI message fields neither implemented nor refused: {missing}"


def test_refused_fields_are_refused_and_off_values_pass():
    from quantserve.server.errors import APIError
    from quantserve.server.unsupported import refuse_unsupported

    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for name, (off, _) in {**OFF_VALUES, **CHAT_ONLY_OFF}.items():
        if name in ChatCompletionRequest.model_fields:
            continue
        for value in off:
            refuse_unsupported(ChatCompletionRequest(**base, **{name: value}), chat=True)
        if off == (None, True, False):  # parallel_tool_calls: every value is harmless without tools
            continue
        on = {"tools": [{"type": "function"}], "modalities": ["audio"], "service_tier": "flex",
              "tool_choice": "required", "function_call": {"name": "f"}}.get(name, "on")
        with pytest.raises(APIError) as e:
            refuse_unsupported(ChatCompletionRequest(**base, **{name: on}), chat=True)
        assert e.value.status == 400 and e.value.param == name
