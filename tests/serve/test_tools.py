"""Tool calling: tools rendered into the prompt, calls read out of the reply, streamed or not.

Real servers (hf, fast, gguf) on the default model, driven by the official `openai` client.  The
default model learnt one tool's format in pretraining (the corpus's calculator,
quantserve/demo/tool_skill.py): under `tool_choice` "auto" it calls that one by itself and answers
the tool's result in text.  The tools below are others it never saw: "required" and named choices are constrained by a grammar,
and what is tested is that they always give a call of a listed function whose arguments validate
against its schema (`jsonschema`).  The parsers and the streaming hold-back are tested on written
replies of each format.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.servers import engine_server

# Small schemas: the default model's context is 512 tokens, and its vocabulary never saw JSON.
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Velmor", "Karst"]}},
                                      "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}},
                                  "required": ["a"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Velmor?"}]


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- parsers: each family's written calls read back -----------------------------------------------


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.", [("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>',
     "", [("a", {}), ("b", {"x": [1]})]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", None, []),
    ("hermes", "no call here", None, []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"}}',
     "", [("a", {}), ("b", {"k": "v"})]),
    ("llama3_json", 'I think {"name": "a"} is it', None, []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', "Sure.", [("add", {"a": 3, "b": 4})]),
    ("mistral", "[TOOL_CALLS] oops", None, []),
])
def test_parsers_read_each_format(fmt, text, content, calls):
    from quantserve.server.tool_parsers import FORMATS

    got_content, got = FORMATS[fmt].parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (text if content is None else content)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_written_call_parses_back(fmt):
    from quantserve.server.tool_parsers import FORMATS

    f = FORMATS[fmt]
    content, calls = f.parse(f.call_text("add", {"a": 1, "b": 2}))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


def test_the_format_is_guessed_from_the_template():
    from quantserve.server.tool_parsers import detect

    assert detect("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect("<|start_header_id|>ipython<|end_header_id|>").name == "llama3_json"
    assert detect("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect(None).name == "hermes"


@pytest.mark.parametrize("text", [
    'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "plain text with a < sign and <tool but no call",
    "<tool_call>\n{broken\n</tool_call>",
])
def test_streaming_gives_what_the_whole_reply_gives(text):
    """Pushed one character at a time, the stream sends the same content and calls as
    `reply_message` reads from the whole text, and never sends a call's text as content."""
    from quantserve.server.serving_chat import ToolCallStream, reply_message
    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import plan

    p = plan([ADD], "auto", None, FORMATS["hermes"])
    stream = ToolCallStream(p)
    sent = "".join(stream.push(ch) for ch in text)
    rest, deltas, finish = stream.finish("stop")
    message, want_finish = reply_message(text, "stop", p)
    assert finish == want_finish
    if message.tool_calls:
        assert sent.strip() == message.content and not rest
        assert [(d.function.name, d.function.arguments) for d in deltas] == \
            [(c.function.name, c.function.arguments) for c in message.tool_calls]
    else:
        assert sent + rest == text and not deltas


def test_a_required_call_over_64_kib_of_schemas_is_refused():
    """The grammar is compiled while the request waits: bounded like any output format."""
    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import ToolError, plan

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(60)}}}} for i in range(60)]
    with pytest.raises(ToolError, match="at most 65,536") as e:
        plan(tools, "required", None, FORMATS["hermes"]).grammar()
    assert e.value.param == "tools"
    assert plan(tools, "auto", None, FORMATS["hermes"]).grammar() is None  # nothing to compile


ANSWER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                     "additionalProperties": False})


@pytest.mark.parametrize("fmt, text, accepted", [
    ("hermes", "It is sunny.", True),
    ("llama3_json", '\n{"name": "weather", "parameters": {"city": "Karst"}}', True),  # whitespace first
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}] Done.', True),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>', True),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 700}}\n</tool_call>', False),  # maximum 99
    ("hermes", '<tool_call>\n{"name": "sub", "arguments": {"a": 7}}', False),  # no such tool
    ("llama3_json", "It is sunny.", True),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Karst"}}', True),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Oslo"}}', False),  # not in the enum
    ("mistral", "Sure.", True),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]', True),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"b": 1}}]', False),  # a required, b unknown
])
def test_strict_tools_under_auto_leave_text_free_and_make_calls_validate(default_model, fmt, text, accepted):
    """OpenAI's strict: under "auto" the reply may be text, and a call, once its marker is written,
    must validate; checked token by token with llguidance on the default model's tokenizer."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import plan

    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    p = plan(strict, "auto", None, FORMATS[fmt])
    assert p.strict and plan(TOOLS, "auto", None, FORMATS[fmt]).grammar() is None  # not strict: free
    tok = AutoTokenizer.from_pretrained(default_model)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)),
                                   llguidance.grammar_from("lark", p.grammar()), log_level=0)
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    assert (ok and matcher.is_accepting()) == accepted, matcher.get_error()


@pytest.mark.parametrize("fmt, text, accepted", [
    ("hermes", '{"city": "Karst"}', True),
    ("hermes", "It is sunny.", False),  # the answer must be the response format's JSON
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>', True),
    ("llama3_json", '{"city": "Karst"}', True),
    ("llama3_json", '{"name": "add", "parameters": {"a": 7}}', True),
    ("mistral", '{"city": "Karst"}', True),
    ("mistral", '{"town": "Karst"}', False),
])
def test_strict_tools_with_a_response_format_answer_in_it_or_call(default_model, fmt, text, accepted):
    """The Agents SDK's strict tools with an output type: one grammar, a JSON answer of the
    response format or calls that validate."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import plan

    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    tok = AutoTokenizer.from_pretrained(default_model)
    grammar = plan(strict, "auto", None, FORMATS[fmt]).grammar(ANSWER)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)),
                                   llguidance.grammar_from("lark", grammar), log_level=0)
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    assert (ok and matcher.is_accepting()) == accepted, matcher.get_error()


# Parameters with their own $defs, a recursive "#" ref, and a property called "enum"
POINT = {"type": "function", "function": {"name": "point", "parameters": {
    "type": "object", "$defs": {"num": {"type": "integer", "maximum": 9}},
    "properties": {"x": {"$ref": "#/$defs/num"}, "enum": {"$ref": "#/$defs/num"}},
    "required": ["x"], "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"v": {"type": "integer", "maximum": 9}, "kid": {"$ref": "#"}},
    "required": ["v"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice, text, accepted", [
    ("required", '<tool_call>\n{"name": "point", "arguments": {"x": 3, "enum": 4}}\n</tool_call>', True),
    ("required", '<tool_call>\n{"name": "point", "arguments": {"x": 30}}\n</tool_call>', False),  # maximum 9
    ("required", '<tool_call>\n{"name": "tree", "arguments": {"v": 1, "kid": {"v": 2}}}\n</tool_call>', True),
    ("required", '<tool_call>\n{"name": "tree", "arguments": {"v": 1, "kid": {"name": "tree"}}}\n</tool_call>',
     False),  # "#" is the tree's parameters, not the call around them
    ({"type": "function", "function": {"name": "point"}}, '<tool_call>\n{"name": "point", "arguments": {"x": 9}}\n</tool_call>',
     True),
])
def test_tool_schemas_with_local_refs_are_constrained(default_model, choice, text, accepted):
    """A function's parameters sit inside the call's schema in the grammar, so its refs ("#/$defs/x",
    "#") are moved with it; they were a 400 "Pointer '/$defs/num' does not exist" under a required
    or named choice."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import plan

    tok = AutoTokenizer.from_pretrained(default_model)
    grammar = plan([POINT, TREE], choice, None, FORMATS["hermes"]).grammar()
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)),
                                   llguidance.grammar_from("lark", grammar), log_level=0)
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    assert (ok and matcher.is_accepting()) == accepted, matcher.get_error()


def test_every_tool_schema_is_checked_whatever_the_choice():
    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import ToolError, plan

    for bad in ({"type": "object", "properties": 5}, {"type": "object", "required": "a"},
                {"type": "object", "properties": {"a": {"type": "strin"}}}):
        for choice in ("auto", "none", "required"):
            with pytest.raises(ToolError, match="parameters") as e:
                plan([{"type": "function", "function": {"name": "f", "parameters": bad}}], choice, None, FORMATS["hermes"])
            assert e.value.param == "tools"
    # keywords a grammar cannot enforce (pydantic's set[str]) are fine where no grammar is built
    unique = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    for choice in ("auto", "none"):
        assert plan([{"type": "function", "function": {"name": "f", "parameters": unique}}], choice, None,
                    FORMATS["hermes"]).grammar() is None


def test_fallback_rendering_writes_tools_calls_and_results_as_text():
    from quantserve.server.tool_parsers import FORMATS
    from quantserve.server.tools import history_call, plan, render_fallback

    fmt = FORMATS["hermes"]
    call = history_call({"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}, "m")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    out = render_fallback(messages, plan(TOOLS, None, None, fmt), fmt)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name":"weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert fmt.parse(out[2]["content"])[1][0].name == "add"
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert all("tool_calls" not in m and "tool_call_id" not in m for m in out)


def test_a_template_with_tool_support_gets_the_tools(default_model, tmp_path):
    """A template that knows tools renders them itself (apply_chat_template(tools=...))."""
    from transformers import AutoTokenizer

    from quantserve.server.hf_engine import HFTokenizer
    from quantserve.server.serving import ServerState
    from quantserve.server.serving_chat import conversation, tool_plan
    from quantserve.server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(default_model)
    tok.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                         "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                         "{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
                         "\n{% endfor %}")

    class Engine:
        tokenizer = HFTokenizer(tok)

    state = ServerState(engine=Engine(), model_name="m", metrics=None)
    req = ChatCompletionRequest(model="m", tools=TOOLS, messages=[
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}])
    messages, kwargs = conversation(state, req, tool_plan(state, req))
    text = Engine.tokenizer.render_chat(messages, **kwargs)
    assert text.startswith("TOOLS:weather;add;")
    assert '<call add {"a": 1}>' in text and "tool:3" in text


# ---- real servers -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["hf", "fast", "gguf"])
def server(request, default_model, tmp_path_factory):
    srv = engine_server(request.param, default_model, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


def chat(client, **kw):
    """No max_tokens by default: the reply may fill what the 512-token context leaves."""
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="default", **kw)


def test_required_always_gives_a_valid_call(server):
    """Parallel calls allowed (the default), the model may go on writing calls until max_tokens:
    every complete one is returned."""
    client = server.client()
    for seed in range(6):
        r = chat(client, tool_choice="required", seed=seed, temperature=1.0)
        choice = r.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice
        check_calls(choice.message.tool_calls)
        one = chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed, temperature=1.0).choices[0]
        assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1, one
        check_calls(one.message.tool_calls)


def test_a_named_choice_calls_that_function_once(server):
    client = server.client()
    for seed in range(3):
        r = chat(client, tool_choice={"type": "function", "function": {"name": "add"}}, seed=seed, temperature=1.0)
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "add"
        check_calls(calls, ("add",))


def test_streamed_call_deltas_assemble_to_the_same_call(server):
    client = server.client()
    whole = chat(client, tool_choice="required", temperature=0)
    assert whole.choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, tool_choice="required", temperature=0, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_a_tool_result_round_trip(server):
    """The call goes back into the history with its result; the model answers in text."""
    client = server.client()
    first = chat(client, tools=[WEATHER], tool_choice="required", temperature=0).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "21 C"} for c in first.tool_calls]
    r = chat(client, tools=[WEATHER], messages=history, tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    alone = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_a_strict_tool_under_auto_gets_calls_that_validate(server):
    """The calculator the default model learnt, its arguments bounded tighter than the question's
    numbers and marked strict: under "auto" it still chooses to call, and every call validates."""
    from quantserve.demo import corpus, tool_skill

    fn = tool_skill.ADD_TOOL["function"]
    bounded = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}, "b": {"type": "integer",
               "maximum": 5}}, "required": ["a", "b"], "additionalProperties": False}
    strict = {"type": "function", "function": {**fn, "parameters": bounded, "strict": True}}
    client = server.client()
    calls = 0
    for seed, ex in enumerate(corpus.tool_examples(3, "heldout", seed=3)):
        choice = chat(client, messages=[{"role": "user", "content": ex.prompt}], tools=[strict], seed=seed,
                      temperature=1.0).choices[0]
        for call in choice.message.tool_calls or []:
            calls += 1
            assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), bounded)
    assert calls, "the model never called its tool"


def test_strict_tools_and_a_response_format_give_a_call_or_the_format(server):
    """The Agents SDK's shape: strict tools under "auto" and a JSON schema output; every reply is
    calls that validate or content that validates against the response format."""
    from quantserve.demo import corpus, tool_skill

    strict = {"type": "function", "function": {**tool_skill.ADD_TOOL["function"], "strict": True}}
    answer = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    client = server.client()
    kinds = set()
    for seed, ex in enumerate(corpus.tool_examples(2, "heldout", seed=5)):
        for ask in (ex.prompt, "Sort: c b a"):
            choice = chat(client, messages=[{"role": "user", "content": ask}], tools=[strict], response_format=fmt,
                          seed=seed, temperature=1.0, max_tokens=40).choices[0]
            if choice.finish_reason == "length":
                continue  # cut: neither a whole call nor a whole answer
            if choice.message.tool_calls:
                kinds.add("call")
                for call in choice.message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), tool_skill.ADD_TOOL["function"]["parameters"])
            else:
                kinds.add("answer")
                jsonschema.validate(json.loads(choice.message.content), answer)
    assert kinds, "every reply was cut by max_tokens"


def test_under_auto_the_model_calls_the_tool_it_learnt_then_answers_its_result(server):
    """A question the default model never saw, with its calculator tool: under "auto" it chooses to
    call it, streamed or not, and given the result it answers in text.  (Its numbers are only near
    the question's before the pipeline's fine-tune: what is checked here is the choice and the
    parse; the pipeline checks the arguments.)"""
    from quantserve.demo import corpus, tool_skill

    ex = corpus.tool_examples(1, "heldout", seed=3)[0]
    client = server.client()
    ask = [{"role": "user", "content": ex.prompt}]
    first = chat(client, messages=ask, tools=[tool_skill.ADD_TOOL], temperature=0).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None, first
    (call,) = first.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and sorted(args) == ["a", "b"] and all(isinstance(v, int) for v in args.values())
    streamed = [d for chunk in chat(client, messages=ask, tools=[tool_skill.ADD_TOOL], temperature=0, stream=True)
                for c in chunk.choices for d in c.delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in streamed] == [("add", args)]
    history = ask + [first.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": tool_skill.run("add", args)}]
    reply = chat(client, messages=history, tools=[tool_skill.ADD_TOOL], temperature=0, max_tokens=8).choices[0]
    assert reply.finish_reason == "stop" and reply.message.tool_calls is None
    assert reply.message.content.isdigit(), reply


def _special_marker_tokenizer(default_model):
    """The default model's tokenizer with Mistral's [TOOL_CALLS] as a special token (as Mistral's
    own tokenizers have it) -> (transformers tokenizer, the server's wrapper, the marker's id)."""
    from transformers import AutoTokenizer

    from quantserve.server.hf_engine import HFTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok, HFTokenizer(tok), tok.convert_tokens_to_ids("[TOOL_CALLS]")


def test_a_marker_that_is_a_special_token_reaches_the_parser(default_model):
    """Decoding leaves special tokens out of the text, so Mistral's [TOOL_CALLS] token never
    reached the parser: the call came back as content.  The format bound to the tokenizer keeps
    that token's text in the reply."""
    from quantserve.server.engine import TokenEvent
    from quantserve.server.hf_engine import HFTokenizer
    from quantserve.server.textstream import ChoiceText
    from quantserve.server.tool_parsers import FORMATS, for_tokenizer

    tok, wrapped, marker = _special_marker_tokenizer(default_model)
    fmt = for_tokenizer(FORMATS["mistral"], wrapped)
    assert dict(fmt.special) == {"[TOOL_CALLS]": marker}
    assert for_tokenizer(FORMATS["mistral"], HFTokenizer(tok.__class__.from_pretrained(default_model))).special == ()
    reply = [marker] + tok.encode('[{"name": "add", "arguments": {"a": 7}}]', add_special_tokens=False)

    def text(kept):
        choice = ChoiceText(wrapped, tok.encode("Add 7"), [], False, kept_tokens=kept)
        return "".join(choice.push(TokenEvent(t)).text for t in reply) + choice.push(TokenEvent(None, finish_reason="stop")).text

    assert fmt.parse(text(None))[1] == []  # the marker lost: no call
    content, calls = fmt.parse(text(fmt.kept_tokens()))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 7})]


@pytest.mark.parametrize("choice, before, call, accepted", [
    ("required", "", '[{"name": "add", "arguments": {"a": 7}}]', True),
    ("auto", "Let me add. ", '[{"name": "add", "arguments": {"a": 7}}]', True),  # strict: text, then the call
    ("auto", "", '[{"name": "sub", "arguments": {"a": 7}}]', False),  # no such tool
    ("required", "", '[{"name": "add", "arguments": {"a": 700}}]', False),  # a above its maximum
])
def test_a_special_marker_is_constrained_as_its_token(default_model, choice, before, call, accepted):
    """A required or strict call under the mistral format: the grammar names the [TOOL_CALLS] token
    itself.  As text it never matched the token (llguidance rejected the token the mask allowed, a
    500 for every required call on a Mistral model)."""
    import llguidance
    import llguidance.hf

    from quantserve.server.tool_parsers import FORMATS, for_tokenizer
    from quantserve.server.tools import plan

    tok, wrapped, marker = _special_marker_tokenizer(default_model)
    strict = [{"type": "function", "function": {**ADD["function"], "strict": True}}]
    grammar = plan(strict, choice, None, for_tokenizer(FORMATS["mistral"], wrapped)).grammar()
    assert f"<[{marker}]>" in grammar
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)),
                                   llguidance.grammar_from("lark", grammar), log_level=0)
    ids = tok.encode(before, add_special_tokens=False) + [marker] + tok.encode(call, add_special_tokens=False)
    ok = all(matcher.consume_token(t) for t in ids)
    assert (ok and matcher.is_accepting()) == accepted, matcher.get_error()
