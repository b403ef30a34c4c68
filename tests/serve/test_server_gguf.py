"""The `gguf` engine (llama.cpp) behind a real server: the default model converted with
`quant.convert`, compared with llama.cpp's own offline generation through llama-cpp-python."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from tests.support.servers import PROMPTS, ServerProcess, collect_stream

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gguf_dirs(default_model, tmp_path_factory):
    from quantserve.quant.convert import convert

    root = tmp_path_factory.mktemp("gguf")
    return {fmt: convert(default_model, f"gguf-{fmt}", root / fmt, progress=False) for fmt in ("f16", "q8_0")}


@pytest.fixture(scope="module")
def server(gguf_dirs):
    srv = ServerProcess(gguf_dirs["f16"], "--max-batch", "32", "--max-logprobs", "4096", name="tiny-gguf")
    yield srv
    assert srv.stop() == 0, srv.log()


class LlamaReference:
    """llama.cpp's own single-sequence generation on the same file (the engine's offline output)."""

    def __init__(self, gguf_file, hf_folder):
        import llama_cpp

        from quantserve.modeling import load_tokenizer

        self.llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=512, logits_all=True, verbose=False,
                                   n_gpu_layers=0, seed=0)
        self.hf = load_tokenizer(hf_folder)

    def chat_ids(self, user: str) -> list[int]:
        text = self.hf.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True)
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def greedy(self, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        out = self.llm.create_completion(prompt_ids, max_tokens=max_tokens, temperature=0.0)
        return out["choices"][0]["text"], out["usage"]["completion_tokens"]

    def logprobs(self, ids: list[int], n_prompt: int):
        import torch

        self.llm.reset()
        self.llm.eval(ids)
        scores = torch.tensor(self.llm.scores[n_prompt - 1: len(ids) - 1])
        return torch.log_softmax(scores, dim=-1)


@pytest.fixture(scope="module")
def reference(gguf_dirs, default_model):
    return LlamaReference(gguf_dirs["f16"] / "model.gguf", default_model)


def test_health_reports_the_gguf_engine(server):
    assert server.health["engine"] == "gguf" and server.health["dtype"] == "F16"
    card = server.client().models.list().data[0].model_dump()
    assert card["id"] == "tiny-gguf" and card["engine"] == "gguf"


def test_chat_greedy_equals_llama_cpp_offline(server, reference):
    client = server.client()
    for user in PROMPTS[:4]:
        ids = reference.chat_ids(user)
        assert ids == reference.hf(reference.hf.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False).input_ids  # the GGUF tokenizer agrees with the original
        text, n_tokens = reference.greedy(ids)
        r = client.chat.completions.create(model="tiny-gguf", messages=[{"role": "user", "content": user}],
                                           temperature=0, max_tokens=MAX_TOKENS)
        assert r.choices[0].message.content == text, user
        assert r.usage.prompt_tokens == len(ids)
        # llama-cpp-python does not count the eos it stopped at; the server does
        assert r.usage.completion_tokens == n_tokens + (r.choices[0].finish_reason == "stop")


def test_streaming_async_stop_seed_and_n(server, reference):
    user = PROMPTS[2]
    expected, _ = reference.greedy(reference.chat_ids(user))
    client = server.client()
    messages = [{"role": "user", "content": user}]
    texts, finish, usage = collect_stream(client.chat.completions.create(
        model="tiny-gguf", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    assert texts == [expected] and usage.completion_tokens > 0

    async def run_async():
        async with server.async_client() as ac:
            r = await ac.chat.completions.create(model="tiny-gguf", messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS, n=2)
            return [c.message.content for c in r.choices]

    assert asyncio.run(run_async()) == [expected, expected]
    stop = expected[1:3]
    r = client.chat.completions.create(model="tiny-gguf", messages=messages, temperature=0,
                                       max_tokens=MAX_TOKENS, stop=stop)
    assert r.choices[0].message.content == expected[:expected.index(stop)]
    kw = dict(model="tiny-gguf", messages=messages, temperature=1.5, max_tokens=12, n=3,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1


def test_logprobs_match_llama_cpp_logits_and_sum_to_one(server, reference):
    user = PROMPTS[1]
    prompt = reference.chat_ids(user)
    vocab = reference.llm.n_vocab()
    r = server.client().chat.completions.create(
        model="tiny-gguf", messages=[{"role": "user", "content": user}], temperature=0, max_tokens=4,
        logprobs=True, top_logprobs=vocab, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    generated = []
    for token in reference.llm.generate(prompt, temp=0.0):  # llama.cpp's own greedy tokens
        generated.append(token)
        if len(generated) == len(content):
            break
    ids = prompt + generated
    ref = reference.logprobs(ids, len(prompt))
    for pos, entry in enumerate(content):
        assert bytes(entry.bytes) == reference.llm.detokenize([generated[pos]], special=True)
        assert len(entry.top_logprobs) == vocab
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) == pytest.approx(1.0, abs=1e-4)
        assert entry.logprob == pytest.approx(float(ref[pos].max()), abs=2e-3)


def test_32_concurrent_streams_are_correct_and_batched(server, reference):
    n, max_tokens = 32, 64  # long enough that 32 arrivals spread over a busy client still overlap
    users = [f"Repeat: {' '.join(chr(97 + (i + j) % 26) for j in range(3))}" for i in range(n)]

    async def one(ac, user):
        t0, text = time.perf_counter(), ""
        stream = await ac.chat.completions.create(model="tiny-gguf", messages=[{"role": "user", "content": user}],
                                                  temperature=0, max_tokens=max_tokens, stream=True,
                                                  extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text, time.perf_counter() - t0

    async def run():
        async with server.async_client() as ac:
            await one(ac, users[0])
            singles = [await one(ac, u) for u in users[:3]]
            before = server.wait_idle()
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(ac, u) for u in users])
            return singles, results, time.perf_counter() - t0, before

    singles, results, wall, before = asyncio.run(run())
    steps, rows = server.decode_steps_and_rows(before)
    for user, (text, _) in list(zip(users, results))[::4]:
        ids = reference.chat_ids(user)
        reference.llm.reset()
        expected = reference.llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0,
                                                   logit_bias=None)["choices"][0]["text"]
        # llama-cpp-python stops at eos; the served stream (ignore_eos) must start with the same text
        assert text.startswith(expected), user
    single_s = sorted(s for _, s in singles)[1]
    print(f"\ngguf: 32 concurrent streams {wall:.2f} s; one alone {single_s:.3f} s; "
          f"ratio {wall / (n * single_s):.3f}; mean decode batch {rows / steps:.1f} over {steps:.0f} steps")
    # Each stream's first token comes from its prompt step, the other max_tokens - 1 from decode steps.
    assert rows == n * (max_tokens - 1)
    # Batched, not one request after another: served one at a time the mean batch would be 1.  (The
    # wall-clock gain is no test on a CPU: there llama.cpp is compute-bound, a 32-row step costs about
    # 32 single steps, and the timing of a shared CI machine decides the ratio.)
    assert rows / steps >= 8


def test_logit_bias_steers_the_gguf_engine(server, reference):
    """llama.cpp's logits go through the same sampler: +100 on one token makes it every pick, at
    temperature 0 and at 1 with top-p; -100 on the greedy token moves the first pick."""
    token = reference.llm.tokenize(b" q", add_bos=False, special=False)[-1]
    client = server.client()
    for kw in (dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=3)):
        r = client.completions.create(model="tiny-gguf", prompt="Repeat: a b", max_tokens=4,
                                      logit_bias={str(token): 100}, extra_body={"ignore_eos": True}, **kw)
        assert r.choices[0].text == reference.llm.detokenize([token] * 4).decode(), kw
    plain = client.completions.create(model="tiny-gguf", prompt="Repeat: a b", max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
    first = reference.llm.tokenize(plain.choices[0].text.encode(), add_bos=False, special=False)[-1]
    banned = client.completions.create(model="tiny-gguf", prompt="Repeat: a b", max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize("kv_cache", ["auto", "int8"])
def test_q8_0_file_serves_llama_cpp_greedy_output(kv_cache, gguf_dirs, default_model):
    """A Q8_0 file's greedy answers equal llama.cpp's offline ones, with its f16 KV cache and with
    `--kv-cache-dtype int8`: llama.cpp's q8_0 K and V cache (llama-server's -ctk/-ctv q8_0, with
    flash attention), which gives the same answers on the default model."""
    ref = LlamaReference(gguf_dirs["q8_0"] / "model.gguf", default_model)
    srv = ServerProcess(gguf_dirs["q8_0"], "--max-batch", "4", "--kv-cache-dtype", kv_cache, name="q8")
    try:
        assert srv.health["dtype"] == "Q8_0"
        assert srv.health["kv_cache_dtype"] == {"auto": "f16", "int8": "q8_0"}[kv_cache]
        for user in PROMPTS[:3]:
            text, _ = ref.greedy(ref.chat_ids(user))
            r = srv.client().chat.completions.create(model="q8", messages=[{"role": "user", "content": user}],
                                                     temperature=0, max_tokens=MAX_TOKENS)
            assert r.choices[0].message.content == text, user
    finally:
        assert srv.stop() == 0, srv.log()


TORCH_FREE_SCRIPT = """
import json, sys
from pathlib import Path
from starlette.testclient import TestClient
from quantserve.server.api_server import create_app
from quantserve.server.engines import EngineOptions, ScheduledEngine

engine = ScheduledEngine(Path(sys.argv[1]), EngineOptions(max_batch=4))
with TestClient(create_app(engine, "m", max_logprobs=8)) as client:
    for _ in range(600):
        if client.get("/health").status_code == 200:
            break
        __import__("time").sleep(0.1)
    r = client.post("/v1/completions", json={"model": "m", "prompt": "the sum of", "max_tokens": 6,
                    "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": -5, "logprobs": 3,
                    "presence_penalty": 0.5, "repetition_penalty": 1.1, "ignore_eos": True})
print(json.dumps({"status": r.status_code, "tokens": r.json().get("usage", {}).get("completion_tokens"),
                  "torch_loaded": "torch" in sys.modules}))
"""


def test_gguf_serving_never_loads_torch(gguf_dirs):
    """The GGUF engine's process stays torch-free through loading, sampling, penalties and logprobs:
    on a GPU host torch and llama.cpp's CUDA build in one process crash it."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TORCH_FREE_SCRIPT, str(gguf_dirs["q8_0"] / "model.gguf")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"status": 200, "tokens": 6, "torch_loaded": False}, result
