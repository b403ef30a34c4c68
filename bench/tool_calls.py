"""Tool calls against any OpenAI-compatible server: how many required calls come back valid.

    python -m bench.tool_calls --base-url http://127.0.0.1:8000/v1 --requests 16

Sends `--requests` chat requests with two small tools and `tool_choice` "required" (half of them
naming a function, half streamed), sampled with seeds, and checks each reply: a call of a listed
function whose arguments validate against its schema (`jsonschema`), and for the streamed ones
that the deltas assemble into such a call.  Prints one JSON line; exits 1 if any reply failed.
"""

from __future__ import annotations

import json
import sys
import time

from quantserve.bench.args import Parser

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid(name: str, arguments: str) -> bool:
    import jsonschema

    if name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def one(client, model: str, i: int) -> tuple[bool, int]:
    """(valid, completion tokens) of request i."""
    choice = {"type": "function", "function": {"name": "add"}} if i % 2 else "required"
    kw = dict(model=model, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, seed=i, temperature=1.0,
              max_tokens=96, messages=[{"role": "user", "content": f"Request {i}: what is {i} + {2 * i}?"}])
    if i % 4 < 2:
        r = client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls or []
        return (len(calls) == 1 and valid(calls[0].function.name, calls[0].function.arguments)
                and r.choices[0].finish_reason == "tool_calls"), r.usage.completion_tokens
    name, args, tokens = "", "", 0
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.function:
                    name += d.function.name or ""
                    args += d.function.arguments or ""
    return valid(name, args), tokens


def main(argv: list[str] | None = None) -> int:
    from openai import OpenAI

    p = Parser(prog="quantserve bench tool-calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--requests", type=int, default=16)
    args = p.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    t0 = time.perf_counter()
    results = [one(client, model, i) for i in range(args.requests)]
    seconds = time.perf_counter() - t0
    ok = sum(v for v, _ in results)
    print(json.dumps({"requests": args.requests, "valid": ok, "completion_tokens": sum(t for _, t in results),
                      "seconds": round(seconds, 2)}))
    return 0 if ok == args.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
