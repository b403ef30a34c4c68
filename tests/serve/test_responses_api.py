"""`/v1/responses` through the official client's `client.responses` on real servers (hf and gguf;
the fast engine shares the same serving layer): text, instructions, streaming events, structured
output, tool calls and a tool-result round trip, and the refusals of a stateless server."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.support.servers import engine_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module", params=["hf", "gguf"])
def client(request, default_model, tmp_path_factory):
    srv = engine_server(request.param, default_model, tmp_path_factory)
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
    c.base = srv.base_url
    yield c
    assert srv.stop() == 0, srv.log()


def chat_text(client, messages, **kw) -> str:
    r = client.chat.completions.create(model="default", messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def test_text_input_answers_as_chat_does(client):
    r = client.responses.create(model="default", input="What is 12 + 30?", temperature=0, max_output_tokens=12)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.output_text == chat_text(client, [{"role": "user", "content": "What is 12 + 30?"}], max_tokens=12)
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"


def test_instructions_and_message_items_are_the_chat_messages(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Sort: d a c b"}]}]
    r = client.responses.create(model="default", instructions="Answer briefly.", input=items, temperature=0,
                                max_output_tokens=10)
    want = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "Sort: d a c b"}], max_tokens=10)
    assert r.output_text == want


def test_max_output_tokens_cut_reports_incomplete(client):
    r = client.responses.create(model="default", input="Repeat: k q m", temperature=0, max_output_tokens=1,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in r.output] == ["incomplete"]  # the message was cut too
    events = list(client.responses.create(model="default", input="Repeat: k q m", temperature=0, max_output_tokens=1,
                                          extra_body={"ignore_eos": True}, stream=True))
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


def test_a_reply_of_no_text_is_an_empty_message(client):
    first = client.responses.create(model="default", input="Repeat: k q m", temperature=0, max_output_tokens=4)
    kw = dict(model="default", input="Repeat: k q m", temperature=0, max_output_tokens=4,
              extra_body={"stop": [first.output_text[0]]})  # stops before the reply's first character
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.output_text == ""
    assert [(item.type, item.status, item.content[0].text) for item in r.output] == [("message", "completed", "")]
    events = list(client.responses.create(**kw, stream=True))
    assert [e.item.content[0].text for e in events if e.type == "response.output_item.done"] == [""]


def test_streamed_events_assemble_to_the_same_text(client):
    whole = client.responses.create(model="default", input="What comes after g?", temperature=0, max_output_tokens=12)
    events = list(client.responses.create(model="default", input="What comes after g?", temperature=0,
                                          max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == text
    assert next(e for e in events if e.type == "response.output_text.done").text == text


def test_json_schema_text_format(client):
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    for seed in range(3):
        r = client.responses.create(model="default", input="Reply in JSON.", text={"format": fmt},
                                    max_output_tokens=60, extra_body={"seed": seed})
        jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_required_tool_call_and_its_result_round_trip(client):
    r = client.responses.create(model="default", input="What is the weather in Velmor?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = client.responses.create(model="default", tools=[WEATHER], max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Velmor?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")
    # the output items sent back as they came (with their ids and statuses) are input too
    again = client.responses.create(model="default", tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Velmor?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert again.status in ("completed", "incomplete")


def test_streamed_named_tool_call(client):
    events = list(client.responses.create(
        model="default", input="Weather in Karst?", tools=[WEATHER], parallel_tool_calls=False, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}))
    done = [e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and done[0].item.name == "get_weather"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == done[0].item.arguments
    jsonschema.validate(json.loads(args), WEATHER["parameters"])


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, None),
    # malformed shapes: a 400 naming the item, never a 500
    ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input.0.content"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]}, "input.0.output"),
    ({"input": [{"type": "function_call_output", "output": "sunny"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input.0.name"),
    ({"input": []}, "input"),
    ({"text": {"format": "json_object"}}, "text.format"),
    ({"text": {"verbosity": "high"}}, "verbosity"),
    ({"text": {"format": {"type": "text"}, "bogus": 1}}, "bogus"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
    # fields nobody reads: refused by name, never dropped
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
    ({"input": [{"role": "user", "content": "hi", "mood": "calm"}]}, "input.0.mood"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "cache": 1}]}]},
     "input.0.content.0.cache"),
    ({"tools": [{**WEATHER, "cache": 1}]}, "tools.0.cache"),
    ({"tool_choice": {"type": "function", "name": "get_weather", "strict": True}, "tools": [WEATHER]},
     "tool_choice.strict"),
    ({"text": {"format": {"type": "json_object", "schema": SCHEMA}}}, "text.format.schema"),
    # what the chat completion underneath finds wrong, named as this request names it
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{oops"}]}, "input.0"),
    ({"instructions": "be brief", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "[1]"}]}, "input.2"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}, "input.1.call_id"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "zzz", "output": "sunny"}]}, "input.2.call_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, None),
])
def test_what_a_stateless_server_cannot_do_is_a_400(client, extra, param):
    body = {"model": "default", "input": "hi", **extra}
    r = httpx.post(client.base + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param)
    # never the chat request's names, which this request has none of
    assert not re.search(r"messages\.|tool_calls|max_completion_tokens|response_format|\.function\b",
                         err["message"] + (err["param"] or "")), err
    assert httpx.get(client.base + "/health").status_code == 200
