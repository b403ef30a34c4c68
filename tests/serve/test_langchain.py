"""Third-party clients against a real server (hf engine, default model).  LangChain's `ChatOpenAI`:
invoke, stream, batch, `with_structured_output` (every method), `bind_tools` with a forced tool,
and the Responses API (`use_responses_api=True`), streamed and not.  LiteLLM's `completion`:
`response_format` json_schema and `tools` with required and named choices.  Real packages, real
server."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import BaseModel, Field

from tests.support.servers import engine_server

langchain_openai = pytest.importorskip("langchain_openai")


class Thing(BaseModel):
    name: str = Field(max_length=8)
    n: int = Field(ge=0, le=9)


class get_weather(BaseModel):  # noqa: N801  (a tool's name, as the model writes it)
    """The weather in a city."""

    city: str = Field(max_length=12)  # bounded: the default model never saw a tool, it would go on


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    srv = engine_server("hf", default_model, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


def chat_model(server, **kw):
    return langchain_openai.ChatOpenAI(base_url=server.base_url + "/v1", api_key="x", model="default",
                                       temperature=0, max_retries=0, **kw)


def test_invoke_stream_and_batch(server):
    llm = chat_model(server, max_tokens=12)
    whole = llm.invoke("What is 12 + 30?")
    assert whole.content and whole.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream("What is 12 + 30?")) == whole.content
    assert [m.content for m in llm.batch(["What is 12 + 30?", "Sort: d a c b"])][0] == whole.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output(server, method):
    llm = chat_model(server)  # no max_tokens: the format ends the reply
    if method == "json_mode":  # json_mode gives any JSON object: ask for the keys in the prompt
        out = llm.with_structured_output(Thing, method=method, include_raw=True).invoke(
            "Reply in JSON with keys name and n.")
        assert out["raw"].content.strip().startswith("{")
        return
    thing = llm.with_structured_output(Thing, method=method, strict=True).invoke("Describe a thing.")
    assert isinstance(thing, Thing)


def test_bind_tools_forced_call(server):
    llm = chat_model(server).bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    ai = llm.invoke("What is the weather in Velmor?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert isinstance(ai.tool_calls[0]["args"]["city"], str)


def test_responses_api(server):
    llm = chat_model(server, max_tokens=12, use_responses_api=True)
    whole = llm.invoke("What comes after g?")
    assert whole.text and whole.usage_metadata["input_tokens"] > 0
    assert "".join(chunk.text for chunk in llm.stream("What comes after g?")) == whole.text
    thing = chat_model(server, use_responses_api=True).with_structured_output(
        Thing, method="json_schema", strict=True).invoke("Describe a thing.")
    assert isinstance(thing, Thing)


def test_litellm_completion_with_response_format_and_tools(server):
    """LiteLLM's OpenAI-compatible provider: a strict json_schema reply validates against its
    schema; a tool under "required" and under a named choice (both constrained by the grammar, as
    the default model never learnt a tool) is called with arguments of its schema."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its model table from the package, not the network
    litellm = pytest.importorskip("litellm")
    import jsonschema

    kw = {"model": "openai/default", "api_base": server.base_url + "/v1", "api_key": "x", "temperature": 0}
    schema = Thing.model_json_schema()
    r = litellm.completion(messages=[{"role": "user", "content": "Describe a thing."}], **kw,
                           response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                                    "strict": True}})
    Thing.model_validate_json(r.choices[0].message.content)
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": get_weather.model_json_schema()}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Velmor?"}],
                               tools=[tool], tool_choice=choice, parallel_tool_calls=False, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
