"""`/v1/embeddings` on every engine through the official client: shapes, normalization, token-id
and base64 inputs, determinism, agreement with transformers' own hidden states and across
engines, mean pooling, `dimensions`, and bad input; LangChain's `OpenAIEmbeddings` too."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.support.servers import ServerProcess

TEXTS = ["What is the capital of Keltria?", "Sort: d a c b", "What is 12 + 30?"]


@pytest.fixture(scope="module")
def reference(default_model):
    """Last-token and mean final hidden states of each text, normalized, in plain transformers."""
    import torch

    from quantserve.modeling import load_model, load_tokenizer

    tok, model = load_tokenizer(default_model), load_model(default_model)
    out = {"last": [], "mean": []}
    for text in TEXTS:
        with torch.inference_mode():
            h = model.model(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0].float().numpy()
        for pooling, v in (("last", h[-1]), ("mean", h.mean(0))):
            out[pooling].append(v / np.linalg.norm(v))
    return out


@pytest.fixture(scope="module", params=["hf", "fast", "gguf"])
def server(request, default_model, tmp_path_factory):
    model = default_model
    if request.param == "gguf":  # f16, so that it agrees with transformers closely
        from quantserve.quant.convert import convert

        model = convert(default_model, "gguf-f16", tmp_path_factory.mktemp("gguf-emb") / "f16", progress=False)
    srv = ServerProcess(model, "--engine", request.param, "--max-batch", "4", name="default")
    srv.kind = request.param
    yield srv
    assert srv.stop() == 0, srv.log()


def test_embeddings_are_the_models_normalized_hidden_states(server, reference):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    r = client.embeddings.create(model="default", input=TEXTS)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    width = httpx.get(server.base_url + "/health").json()["hidden_size"]
    assert [d.index for d in r.data] == [0, 1, 2] and got.shape == (3, width)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tol = 2e-2 if server.kind == "gguf" else 1e-4
    np.testing.assert_allclose(got, np.array(reference["last"]), atol=tol)
    assert r.usage.prompt_tokens == r.usage.total_tokens > 0
    again = client.embeddings.create(model="default", input=TEXTS[0]).data[0].embedding  # deterministic
    np.testing.assert_allclose(again, got[0], atol=1e-6 if server.kind != "gguf" else 1e-4)


def test_token_ids_and_base64(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    ids = httpx.post(server.base_url + "/tokenize", json={"model": "default", "prompt": TEXTS[1]}).json()["tokens"]
    from_ids = client.embeddings.create(model="default", input=[ids]).data[0].embedding
    from_text = client.embeddings.create(model="default", input=TEXTS[1]).data[0].embedding
    np.testing.assert_allclose(from_ids, from_text, atol=1e-5)
    raw = httpx.post(server.base_url + "/v1/embeddings", json={"model": "default", "input": TEXTS[1],
                                                                 "encoding_format": "base64"}).json()
    import base64

    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    np.testing.assert_allclose(decoded, from_text, atol=1e-6)
    # the official client asks for base64 by default and decodes it itself: the floats above


def test_embeddings_while_generating(server):
    """An embedding shares the scheduler with running generations; both come back right."""
    import concurrent.futures

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    alone = client.embeddings.create(model="default", input=TEXTS[2]).data[0].embedding
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gen = [pool.submit(client.completions.create, model="default", prompt=t, max_tokens=24, temperature=0)
               for t in TEXTS]
        embs = [pool.submit(client.embeddings.create, model="default", input=TEXTS[2]) for _ in range(3)]
        assert all(g.result().choices[0].text is not None for g in gen)
        for e in embs:
            np.testing.assert_allclose(e.result().data[0].embedding, alone, atol=1e-4)


def test_a_client_leaving_mid_request_is_not_an_error(server):
    """A client that gives up on a long embedding request: its sequences are cancelled, the server
    logs no error (asyncio's "exception was never retrieved" of the cancelled gather, once), and
    the next request is answered."""
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/embeddings", json={"model": "default", "input": [[5] * 400] * 256},
                   timeout=0.3)
    assert server.wait_idle(60)["quantserve:num_requests_running"] == 0
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "default", "input": "x"}, timeout=30)
    assert r.status_code == 200
    assert "ERROR" not in server.log() and "never retrieved" not in server.log()


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10 ** 9]}, "input"),
    ({"input": "x", "dimensions": 3}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "model": "nope"}, "model"),
    ({"input": "x " * 5000}, "input"),
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({"input": [[5] * 400] * 751}, "input"),  # 300,400 tokens: past OpenAI's 300,000 a request
])
def test_bad_embedding_requests_are_400s(server, body, param):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "default", **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_dimensions_equal_to_the_models_width_is_honoured(server):
    width = httpx.get(server.base_url + "/health").json()["hidden_size"]
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": "default", "input": "x", "dimensions": width})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == width


def test_mean_pooling_and_agreement_across_engines(default_model, reference, tmp_path_factory):
    srv = ServerProcess(default_model, "--engine", "fast", "--embedding-pooling", "mean", name="default")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        got = np.array([d.embedding for d in client.embeddings.create(model="default", input=TEXTS).data])
        np.testing.assert_allclose(got, np.array(reference["mean"]), atol=1e-4)
    finally:
        assert srv.stop() == 0, srv.log()


def test_langchain_openai_embeddings(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    emb = langchain_openai.OpenAIEmbeddings(base_url=server.base_url + "/v1", api_key="x", model="default",
                                            check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS[:2])
    query = emb.embed_query(TEXTS[0])
    assert len(docs) == 2 and len(query) == len(docs[0])
    np.testing.assert_allclose(query, docs[0], atol=1e-4)
