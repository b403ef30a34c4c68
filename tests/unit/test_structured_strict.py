"""OpenAI's strict JSON schemas: every object schema that leaves `additionalProperties` out is
closed, wherever it sits, and nothing else in the schema changes (structured._closed)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from quantserve.server.structured import output_format

OPEN = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "properties": {"type": "object", "properties": {"type": {"type": "string"}}},  # names that are keywords
        "list": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"y": {"type": "string"}}}, {"type": "null"}]},
        "free": {"type": "object", "additionalProperties": True},  # the schema's own choice is kept
        "ref": {"$ref": "#/$defs/node"},
    },
    "required": ["a"],
    "$defs": {"node": {"type": ["object", "null"], "properties": {"v": {"type": "integer"}}}},
}


def _schema(strict) -> dict:
    spec = {"name": "x", "schema": OPEN, **({} if strict is None else {"strict": strict})}
    return json.loads(output_format({"type": "json_schema", "json_schema": spec}).text)


def test_strict_closes_every_object_schema_that_does_not_say():
    closed = _schema(True)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert set(props["properties"]["properties"]) == {"type"}  # a property called "type" is not a keyword
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False and props["either"]["anyOf"][1] == {"type": "null"}
    assert props["free"]["additionalProperties"] is True
    assert closed["$defs"]["node"]["additionalProperties"] is False
    assert "additionalProperties" not in props["a"]
    reply = {"a": 1, "properties": {"type": "t"}, "list": [{"x": 1.5}], "either": {"y": "z"}, "free": {"k": 1},
             "ref": {"v": 2}}
    jsonschema.validate(reply, closed)
    for extra in ({"b": 2}, {"properties": {"type": "t", "more": 1}}, {"list": [{"x": 1, "z": 0}]},
                  {"either": {"y": "z", "w": 1}}, {"ref": {"v": 2, "u": 3}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**reply, **extra}, closed)
        jsonschema.validate({**reply, **extra}, OPEN)  # what the open schema let through


@pytest.mark.parametrize("strict", [None, False])
def test_a_schema_without_strict_keeps_json_schemas_meaning(strict):
    assert _schema(strict) == OPEN
