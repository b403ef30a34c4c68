"""Structured output on every engine: JSON schemas, JSON objects, choices, regexes, grammars.

Real servers (hf, fast, gguf) on the default model, driven by the official `openai` client.  The
default model never saw JSON, so what it writes inside the format is nonsense; what is tested is
that it is always valid: every reply parses and validates against its schema with `jsonschema`.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.support.servers import engine_server

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 8}}, "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                        "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    "enum_and_number": {"type": "object", "properties": {
        "unit": {"enum": ["kg", "lb"]}, "weight": {"type": "number", "minimum": 0, "maximum": 500, "multipleOf": 0.25}},
        "required": ["unit", "weight"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "b": {"type": "string", "maxLength": 5}},
                 "required": ["a"], "additionalProperties": False},
}
MAX_TOKENS = 96


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Reply in JSON."}])
    return client.chat.completions.create(model="default", max_tokens=MAX_TOKENS, **kw)


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.fixture(scope="module", params=["hf", "fast", "gguf"])
def server(request, default_model, tmp_path_factory):
    srv = engine_server(request.param, default_model, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_json_schema_replies_always_validate(server):
    """50 seeded, sampled requests over five schemas, half of them streamed (hf); 10 elsewhere."""
    client = server.client()
    seeds = range(10) if server.health["engine"] == "hf" else range(2)
    done = 0
    for name, schema in SCHEMAS.items():
        for seed in seeds:
            kw = dict(response_format=json_schema_format(name), seed=seed, temperature=1.0)
            if seed % 2:
                text, finish = streamed_text(chat(client, stream=True, **kw))
            else:
                r = chat(client, **kw)
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert finish == "stop", (name, seed, text)  # bounded schemas always finish
            jsonschema.validate(json.loads(text), schema)
            done += 1
    assert done == len(SCHEMAS) * len(seeds)


def test_greedy_json_schema_is_deterministic_and_valid(server):
    client = server.client()
    a = chat(client, response_format=json_schema_format("nested"), temperature=0).choices[0].message.content
    b = chat(client, response_format=json_schema_format("nested"), temperature=0).choices[0].message.content
    assert a == b
    jsonschema.validate(json.loads(a), SCHEMAS["nested"])


def test_json_object_replies_parse(server):
    """A free-form object can be cut by max_tokens (the default model, which saw JSON only in its
    tool's listing and calls, mostly writes on inside a string at temperature 1); what ended must
    parse.  One reply that ends for sure: greedy, with the tool's listing in the prompt, the model
    writes an object of the shape it learnt, and the grammar ends the reply where the object ends."""
    from quantserve.demo import tool_skill

    client = server.client()
    for seed in range(6):
        r = chat(client, response_format={"type": "json_object"}, seed=seed, temperature=1.0)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
    r = chat(client, response_format={"type": "json_object"}, temperature=0, tools=[tool_skill.ADD_TOOL],
             tool_choice="none", messages=[{"role": "user", "content": "What is 3 + 4?"}])
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(server):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        unit: Literal["kg", "lb"]
        count: int = Field(ge=0, le=50)

    r = server.client().chat.completions.parse(model="default", messages=[{"role": "user", "content": "weigh"}],
                                                response_format=Reading, max_tokens=MAX_TOKENS, seed=3)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Reading) and parsed.unit in ("kg", "lb")


def test_completions_choice_regex_and_grammar(server):
    client = server.client()
    r = client.completions.create(model="default", prompt="Colour:", max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="default", prompt="Code:", max_tokens=12, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text)
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'
    r = client.completions.create(model="default", prompt="Sum:", max_tokens=20, seed=1, temperature=1.0,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    text = r.choices[0].text
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text) or r.choices[0].finish_reason == "length", text
    r = client.completions.create(model="default", prompt="Object:", max_tokens=MAX_TOKENS,
                                  extra_body={"response_format": json_schema_format("flat")})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["flat"])


def test_n_choices_each_follow_the_format(server):
    r = chat(server.client(), response_format=json_schema_format("array"), n=3, seed=5, temperature=1.0)
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["array"])
    # greedy choices decode side by side: one masked argmax over their rows, masks computed together
    r = chat(server.client(), response_format=json_schema_format("nested"), n=3, temperature=0)
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1
    jsonschema.validate(json.loads(texts.pop()), SCHEMAS["nested"])


BAD_FORMATS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "response_format", "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "'name'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "description": "x" * (1 << 20)}}}}}},
     "response_format", "at most"),
    ({"guided_regex": "[a-"}, "guided_regex", "cannot be compiled"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "cannot be compiled"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "not supported"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one output format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format", "strict"),
    ({"structured_outputs": {"json": False}}, "structured_outputs.json", ""),  # a schema nothing matches
    ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs", "at most"),
]


@pytest.mark.parametrize("body, param, needle", BAD_FORMATS, ids=[b[1] + ":" + b[2] for b in BAD_FORMATS])
def test_bad_formats_are_400s_naming_the_field(server, body, param, needle):
    import httpx

    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # still serving


def test_a_strict_schema_allows_only_its_properties(server):
    """strict: true closes objects whose schema leaves additionalProperties out (OpenAI's strict mode):
    the reply has only the listed keys.  Open, the default model added keys and repeated them."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "closed", "schema": schema, "strict": True}}
    for seed in range(4):
        r = chat(server.client(), response_format=fmt, seed=seed, temperature=1.0)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        reply = json.loads(r.choices[0].message.content)
        assert list(reply) == ["a"], reply


def test_recursive_schema_is_served(server):
    """A schema that refers to itself (a tree) is a real use, not an attack: it compiles and the
    reply validates (bounded by max_tokens: a cut reply is allowed, a wrong one is not)."""
    tree = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["v"], "additionalProperties": False}
    r = chat(server.client(), response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": tree}},
             seed=2, temperature=1.0)
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), tree)


def test_a_schema_with_no_finite_instance_is_a_400(server):
    """An object that must contain itself compiles, and its grammar gives out while generating
    (llguidance's forced-token limit).  That is the request's fault: a 400 naming the format, or
    an error event when streamed; it was a 500 "engine_error" with a traceback in the log."""
    import httpx

    endless = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
               "$ref": "#/$defs/n"}
    body = {"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "endless", "schema": endless}}}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_output_format" and "finite instance" in err["message"], err
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=120, json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert any('"invalid_output_format"' in e for e in events), events[-3:]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # still serving
    assert "Traceback" not in server.log()


def test_openai_client_errors_are_bad_requests(server):
    with pytest.raises(openai.BadRequestError):
        chat(server.client(), response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})


@pytest.mark.parametrize("width", [70, 96, 130])  # logits narrower, as wide as, and wider than the masks
def test_masked_argmax_agrees_on_torch_and_numpy(width):
    import numpy as np
    import torch

    from quantserve.server.sampling import masked_argmax

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, width)).astype(np.float32)
    allowed = rng.random((3, 96)) < 0.2
    allowed[:, 0] = True  # every row allows something inside the narrowest logits
    words = np.packbits(allowed, axis=-1, bitorder="little").view(np.int32)
    rows = [0, 2, 3]
    expected = [int(np.argmax(np.where(np.pad(allowed[i], (0, max(0, width - 96)))[:width], logits[r], -np.inf)))
                for i, r in enumerate(rows)]
    assert masked_argmax(logits, rows, words) == expected
    assert masked_argmax(torch.from_numpy(logits), rows, words) == expected


@pytest.mark.parametrize("n_vocab", [742, 128256])  # the default tokenizer alone, and padded to Llama-3's logits
def test_batch_bitmasks_match_one_by_one(default_model, n_vocab):
    import llguidance.hf
    import numpy as np

    from quantserve.modeling import load_tokenizer
    from quantserve.server.structured import GrammarCompiler, OutputFormat, batch_bitmasks

    tok = load_tokenizer(default_model)
    compiler = GrammarCompiler(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab))
    fmt = OutputFormat("json", json.dumps(SCHEMAS["flat"]), "response_format")
    a, b = compiler.matcher(fmt), compiler.matcher(fmt)
    a.accept(int(np.flatnonzero(a.mask(n_vocab))[0]))  # the two now stand at different places
    together = batch_bitmasks([a, b])
    assert together.shape[1] * 32 >= n_vocab
    assert (together[0] == a.bitmask()).all() and (together[1] == b.bitmask()).all()


def test_a_format_that_fails_once_fails_every_time(default_model):
    """A regex past llguidance's lexer limit fails at its first steps.  Its compiled matcher's
    copies share the lexer, so a cached template left in error made every later request end at
    once with "" and finish_reason "stop", as if the format had been followed: each request must
    fail the same way, one by one and computed in a batch."""
    import llguidance.hf
    import numpy as np

    from quantserve.modeling import load_tokenizer
    from quantserve.server.exceptions import OutputFormatError
    from quantserve.server.structured import GrammarCompiler, OutputFormat, batch_bitmasks

    tok = load_tokenizer(default_model)
    compiler = GrammarCompiler(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)))
    fmt = OutputFormat("regex", "(a{1000}){1000}", "guided_regex")

    def follow(batched: bool):
        constraints = [compiler.matcher(fmt) for _ in range(2 if batched else 1)]
        for _ in range(4):
            masks = batch_bitmasks(constraints) if batched else [constraints[0].bitmask()]
            for constraint, mask in zip(constraints, masks):
                constraint.accept(int(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]))

    for attempt in range(3):
        with pytest.raises(OutputFormatError, match="too many expressions"):
            follow(batched=attempt == 2)
