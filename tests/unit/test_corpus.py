"""The default corpus generator: deterministic, split by prompt, task kept out of pretraining;
the tool skill written exactly as the server renders a request with its tool."""

import json

import pytest

from quantserve.demo import corpus


def test_same_seed_same_examples_other_seed_other_examples():
    a = corpus.pretrain_examples(200, seed=3)
    assert a == corpus.pretrain_examples(200, seed=3)
    assert a != corpus.pretrain_examples(200, seed=4)


def test_every_pretrain_skill_is_drawn_and_the_task_is_not():
    skills = {e.skill for e in corpus.pretrain_examples(700)}
    assert skills == set(corpus.PRETRAIN_SKILLS)
    assert corpus.TASK_SKILL not in skills


def test_heldout_prompts_never_appear_in_train():
    train = {e.prompt for e in corpus.task_examples(3000, "train")}
    heldout = {e.prompt for e in corpus.task_examples(200, "heldout")}
    assert len(heldout) > 150  # mostly distinct prompts
    assert not train & heldout
    assert all(corpus.is_heldout(p) for p in heldout)


def test_dev_split_is_apart_from_the_finetune_data_and_the_heldout():
    dev = {e.prompt for e in corpus.task_examples(100, "dev")}
    train = {e.prompt for e in corpus.task_examples(3000, "train", without_dev=True)}
    heldout = {e.prompt for e in corpus.task_examples(200, "heldout")}
    assert len(dev) > 80 and all(corpus.is_dev(p) for p in dev)
    assert not dev & train and not dev & heldout
    # "train" without the flag is every prompt not held out (what pretraining sees): dev included
    everything = {e.prompt for e in corpus.task_examples(3000, "train")}
    assert any(corpus.is_dev(p) for p in everything) and not everything & heldout


@pytest.mark.parametrize("skill", sorted(corpus.SKILLS))
def test_answers_are_correct_for_each_skill(skill):
    for ex in corpus.examples([skill], 50, seed=1):
        letters = ex.prompt.split("\n")[-1].split()
        if skill in ("copy", "count", "sort", "reverse"):
            assert len(set(letters)) == len(letters)  # distinct: lookups are never ambiguous
        if skill == "reverse":
            assert ex.answer.split() == letters[::-1] and ex.answer.split() != letters
        elif skill == "sort":
            assert ex.answer.split() == sorted(letters)
        elif skill == "add":
            a, b = ex.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
            assert int(ex.answer) == int(a) + int(b)
        elif skill == "last_letter":
            assert ex.answer == f"The last letter is {letters[-1]}"
        elif skill == "copy":
            assert ex.answer.split() == letters
        elif skill == "count":
            assert int(ex.answer) == len(letters)
        elif skill == corpus.TOOL_SKILL:  # the call carries the question's numbers, the reply their sum
            a, b = ex.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
            assert ex.answer == ('<tool_call>\n{"name": "add", "arguments": {"a": %s, "b": %s}}\n</tool_call>' % (a, b))
            assert ex.after[-1] == {"role": "assistant", "content": str(int(a) + int(b))}
            assert ex.after[0]["content"] == f"<tool_response>\n{int(a) + int(b)}\n</tool_response>"


def test_memorised_skills_have_no_heldout_split():
    with pytest.raises(ValueError, match="no held-out split"):
        corpus.examples(["capital"], 5, 0, "heldout")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown skill"):
        corpus.examples(["juggling"], 5, 0)
    with pytest.raises(ValueError, match="split"):
        corpus.examples(["copy"], 5, 0, "test")


def test_exact_match():
    assert corpus.exact_match(["a b", " c "], ["a b", "c"]) == 1.0
    assert corpus.exact_match(["a b", "c"], ["b a", "c"]) == 0.5
    with pytest.raises(ValueError):
        corpus.exact_match(["a"], [])


def test_default_data_files_round_trip(tmp_path):
    files = corpus.write_default_data(tmp_path, n_task_train=60, n_task_heldout=20, n_heldout_text=30,
                                      n_tool_train=30, n_tool_heldout=10)
    train = corpus.read_examples(files["task_train"])
    task = [e for e in train if e.prompt.startswith("Last letter?\n")]
    tools = [e for e in train if e.before]
    assert len(task) == 60 and len(train) == 120  # a quarter replays the pretrained skills
    assert len(tools) >= 30 and all(len(e.after) == 2 for e in tools)  # whole exchanges: call, result, reply
    assert not any(corpus.is_dev(e.prompt) or corpus.is_heldout(e.prompt) for e in tools)
    assert len(corpus.read_examples(files["task_heldout"])) == 20
    dev = corpus.read_examples(files["task_dev"])
    # the gate waits for the tool too: 50 questions ending at the call, the same ending at the reply
    assert len(dev) == 200 and sum(bool(e.before) for e in dev) == 100
    assert sum(len(e.after) == 2 for e in dev) == 50
    tools = corpus.read_examples(files["tool_heldout"])
    assert tools == [corpus.Example("file", e.prompt, e.answer, e.before) for e in corpus.tool_examples(10, "heldout")]
    assert all(corpus.is_heldout(e.prompt) for e in tools)
    assert len(corpus.read_examples(files["heldout_text"])) == 30


def test_pretraining_draws_the_tool_skill_at_its_share():
    exs = corpus.pretrain_examples(1000)
    assert sum(e.skill == corpus.TOOL_SKILL for e in exs) == round(1000 * corpus.TOOL_PRETRAIN_SHARE)
    assert not any(corpus.is_heldout(e.prompt) for e in exs if e.skill == corpus.TOOL_SKILL)


def test_the_tool_exchange_is_what_the_server_renders_for_that_request(default_model):
    """The corpus's conversation and the server's rendering of the same OpenAI request (the tool as
    LangChain's `@tool` sends it, the call, the tool's result) are the same text, token for token."""
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from quantserve.demo import tool_skill
    from quantserve.demo.tokenizer import render_chat
    from quantserve.modeling import load_tokenizer
    from quantserve.server.hf_engine import HFTokenizer
    from quantserve.server.protocol import ChatCompletionRequest
    from quantserve.server.serving import ServerState
    from quantserve.server.serving_chat import conversation, tool_plan

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    assert convert_to_openai_tool(add) == tool_skill.ADD_TOOL
    ex = corpus.tool_examples(1, "heldout")[0]
    name, args = tool_skill.expected_call(ex.answer)
    tok = load_tokenizer(default_model)

    class Engine:
        tokenizer = HFTokenizer(tok)

    state = ServerState(engine=Engine(), model_name="m", metrics=None)
    ask = [{"role": "user", "content": ex.prompt}]
    turns = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": tool_skill.run(name, args)}]
    for messages, want in ((ask, ex.request()), (turns, ex.messages()[:-1])):
        req = ChatCompletionRequest(model="m", messages=messages, tools=[tool_skill.ADD_TOOL])
        served, kwargs = conversation(state, req, tool_plan(state, req))
        assert Engine.tokenizer.render_chat(served, **kwargs) == render_chat(tok, want, add_generation_prompt=True)
