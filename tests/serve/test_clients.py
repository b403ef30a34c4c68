"""Third-party clients against a real server (hf engine, default model), real packages:
LangChain's `ChatOpenAI` (invoke, stream, batch, `with_structured_output` by every method,
`bind_tools` with a forced tool, the Responses API streamed and not) and LiteLLM's `completion`
with `response_format` and `tools`.  (A LangChain agent's tool loop runs on the pipeline's
fine-tuned model: tests/train/test_pipeline.py.)"""

from __future__ import annotations

import json
import os

import jsonschema
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


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its model table from the package, not the network
    return pytest.importorskip("litellm")


def test_litellm_completion_with_response_format_and_tools(server, litellm):
    """A strict json_schema reply validates; the default model's tool is called under "auto" (its
    choice) and under a named choice (the grammar's), with arguments of the tool's schema."""
    from quantserve.demo import corpus, tool_skill

    kw = {"model": "openai/default", "api_base": server.base_url + "/v1", "api_key": "x", "temperature": 0}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    r = litellm.completion(messages=[{"role": "user", "content": "Describe a thing."}], **kw,
                           response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                                    "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    ex = corpus.tool_examples(1, "heldout", seed=6)[0]
    for choice in ("auto", {"type": "function", "function": {"name": "add"}}):
        r = litellm.completion(messages=[{"role": "user", "content": ex.prompt}], tools=[tool_skill.ADD_TOOL],
                               tool_choice=choice, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), tool_skill.ADD_TOOL["function"]["parameters"])
