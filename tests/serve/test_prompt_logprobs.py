"""`/v1/completions` with `echo` and `logprobs` (and `max_tokens: 0`): the prompt's own
log-probabilities, on every engine, against the model's logits computed in-process; and
lm-evaluation-harness's `local-completions` model scoring a local task against our server as its
in-process `hf` model scores it."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from tests.support.servers import ServerProcess

PROMPT = "What is the capital of Keltria? The capital of Keltria is"


@pytest.fixture(scope="module")
def reference(default_model):
    """Per-token log-probabilities of the prompt under the checkpoint, in plain transformers."""
    import torch

    from quantserve.modeling import load_model, load_tokenizer

    tok, model = load_tokenizer(default_model), load_model(default_model)
    ids = tok(PROMPT)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return ids, [None] + [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)], lp


@pytest.fixture(scope="module", params=["hf", "fast", "gguf"])
def server(request, default_model, tmp_path_factory):
    model = default_model
    if request.param == "gguf":  # f16: its logprobs compare with transformers' closely
        from quantserve.quant.convert import convert

        model = convert(default_model, "gguf-f16", tmp_path_factory.mktemp("gguf-lp") / "f16", progress=False)
    srv = ServerProcess(model, "--engine", request.param, "--max-batch", "4", name="default")
    srv.kind = request.param
    yield srv
    assert srv.stop() == 0, srv.log()


def completions(srv, **body):
    return httpx.post(srv.base_url + "/v1/completions", json={"model": "default", **body}, timeout=60)


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(server, reference):
    ids, want, _ = reference
    r = completions(server, prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    tol = 2e-2 if server.kind == "gguf" else 1e-3
    np.testing.assert_allclose(lp["token_logprobs"][1:], want[1:], atol=tol)
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert token in top and top[token] == logprob  # the prompt's own token is always there
        assert 2 <= len(top) <= 3 and max(top.values()) >= logprob - 1e-6
    assert choice["text"] == server_text(server, ids)


def server_text(srv, ids) -> str:
    return httpx.post(srv.base_url + "/detokenize", json={"model": "default", "tokens": ids}).json()["prompt"]


def test_lm_eval_payload_echo_logprobs_one_token(server, reference):
    """What lm-evaluation-harness's local-completions sends for log-likelihood: the prompt's
    logprobs followed by one generated token's."""
    ids, want, lp_all = reference
    r = completions(server, prompt=[ids, ids[:5]], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    assert r.status_code == 200, r.text
    first, second = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(first["logprobs"]["token_logprobs"]) == len(ids) + 1
    assert len(second["logprobs"]["token_logprobs"]) == 6
    greedy = int(lp_all[-1].argmax())  # the generated token is the greedy one, scored as such
    tol = 2e-2 if server.kind == "gguf" else 1e-3
    assert first["logprobs"]["token_logprobs"][-1] == pytest.approx(float(lp_all[-1, greedy]), abs=tol)
    np.testing.assert_allclose(second["logprobs"]["token_logprobs"][1:5], want[1:5], atol=tol)


def test_streamed_echo_with_logprobs(server, reference):
    ids, want, _ = reference
    chunks = []
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"model": "default", "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "ignore_eos": True,
                            "temperature": 0, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    echoed = chunks[0]["choices"][0]
    assert echoed["text"] == server_text(server, ids)
    tol = 2e-2 if server.kind == "gguf" else 1e-3
    np.testing.assert_allclose(echoed["logprobs"]["token_logprobs"][1:], want[1:], atol=tol)
    generated = [c["choices"][0] for c in chunks[1:] if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum(len(c["logprobs"]["tokens"]) for c in generated) == 3
    offsets = [o for c in [echoed, *generated] for o in c["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets)


def _streamed_logprobs(srv, body) -> tuple[str, dict]:
    """The text and the concatenated legacy logprobs of a streamed one-choice completion."""
    text, lp = "", {"tokens": [], "text_offset": []}
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={"model": "default", **body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    for name in lp:
                        lp[name] += (c["logprobs"] or {}).get(name, [])
    return text, lp


def test_text_offsets_point_into_the_returned_text_streamed_or_not(server):
    """Each token's text_offset is where it starts in the choice's text (the echoed prompt, then the
    generated text); special tokens (BOS) take no room; streaming gives the same offsets."""
    body = {"prompt": "Sort: d a c b", "echo": True, "logprobs": 0, "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    whole = completions(server, **body).json()["choices"][0]
    streamed_text, streamed = _streamed_logprobs(server, body)
    assert streamed_text == whole["text"] and streamed["text_offset"] == whole["logprobs"]["text_offset"]
    text, offsets, tokens = whole["text"], whole["logprobs"]["text_offset"], whole["logprobs"]["tokens"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    n_prompt = len(tokens) - 6
    assert offsets[n_prompt] == len("Sort: d a c b")  # the first generated token starts after the echo
    assert text.startswith("Sort")
    sort = next(k for k, t in enumerate(tokens) if t.strip() == "Sort" or t.strip() == "S")
    assert offsets[sort] == 0 and all(o == 0 for o in offsets[:sort])  # BOS before it takes no room
    for off, tok in zip(offsets, tokens):  # every token that is plain text is found where it says
        if tok and tok.isprintable() and not tok.startswith("<"):
            want = tok.lstrip() if off == 0 else tok  # a text's first word may drop its leading space
            assert text[off:off + len(want)] == want, (off, tok, text)


def test_special_tokens_written_in_a_prompt_take_their_room_in_its_offsets(server):
    """A raw ChatML prompt: its <|im_start|> is in the echoed text, so the words after it are found
    where their offsets say (the BOS the tokenizer adds is not in the text, and takes no room)."""
    prompt = "<|im_start|>Sort: d a<|im_end|>"
    r = completions(server, prompt=prompt, echo=True, logprobs=0, max_tokens=1, temperature=0)
    lp = r.json()["choices"][0]["logprobs"]
    text = r.json()["choices"][0]["text"]
    assert text.startswith(prompt)
    where = dict(zip(lp["tokens"], lp["text_offset"]))
    assert text[where["<|im_start|>"]:].startswith("<|im_start|>")
    sort = next(t for t in lp["tokens"] if t.strip() == "Sort")
    assert text[where[sort]:].startswith("Sort") and text[where["<|im_end|>"]:].startswith("<|im_end|>")


def test_top_logprobs_always_include_the_sampled_token(server):
    r = completions(server, prompt=PROMPT, logprobs=0, max_tokens=4, temperature=1.0, seed=7)
    lp = r.json()["choices"][0]["logprobs"]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {token: logprob}


def test_max_tokens_zero_needs_echo(server):
    r = completions(server, prompt=PROMPT, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert completions(server, prompt=PROMPT, max_tokens=1).status_code == 200


# ---- lm-evaluation-harness ----------------------------------------------------------------------

TASK = """task: keltria_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "What is the capital of {{{{country}}}}?"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def test_lm_eval_scores_a_local_task_through_the_server_as_in_process(default_model, tmp_path):
    """lm_eval's `local-completions` model against our hf server, and lm_eval's own `hf` model
    on the same checkpoint in-process: the summed log-likelihoods of every choice agree within
    1 % (and so do the accuracies)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from quantserve.demo import corpus

    facts = list(zip(corpus.COUNTRIES, corpus.CAPITALS))
    rows = []
    for i, (country, capital) in enumerate(facts[:12]):
        others = [c for _, c in facts if c != capital][i % 5:i % 5 + 3]
        rows.append({"country": country, "choices": [capital, *others], "answer": 0})
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "keltria.yaml").write_text(TASK.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))

    def run(model: str, model_args: str) -> dict:
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["keltria_capitals"],
                                      task_manager=tasks, batch_size=1, log_samples=True, limit=None)
        return out

    srv = ServerProcess(default_model, "--engine", "hf", name="default")
    try:
        remote = run("local-completions", f"model=default,base_url={srv.base_url}/v1/completions,"
                     f"tokenizer={default_model},tokenizer_backend=huggingface,tokenized_requests=True,"
                     "num_concurrent=1,max_retries=1")
    finally:
        assert srv.stop() == 0, srv.log()
    # the API model sends no BOS unless told (and then adds it to the continuation too): so neither does hf
    local = run("hf", f"pretrained={default_model},dtype=float32,device=cpu,add_bos_token=False")

    def loglikelihoods(out):  # every choice's summed log-likelihood, document by document
        return [float(ll) for s in out["samples"]["keltria_capitals"] for ll, _ in s["filtered_resps"]]

    a, b = loglikelihoods(remote), loglikelihoods(local)
    assert len(a) == len(b) == sum(len(r["choices"]) for r in rows)
    assert all(math.isclose(x, y, rel_tol=0.01, abs_tol=1e-3) for x, y in zip(a, b)), list(zip(a, b))
    acc = lambda out: out["results"]["keltria_capitals"]["acc,none"]  # noqa: E731
    assert acc(remote) == pytest.approx(acc(local))


def test_token_ids_past_the_vocabulary_are_a_400_before_anything_decodes_them(server):
    """On every engine (llama.cpp's detokenizer crashes the process on such an id)."""
    r = completions(server, prompt=[1, 10 ** 6], max_tokens=1, echo=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.get(server.base_url + "/health").status_code == 200
