"""Automatic prefix caching (server/prefix_cache.py): the bookkeeping alone, each real backend's
K/V copies against a cold prefill, and real servers of every engine through the `openai` client."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import numpy as np
import openai
import pytest

from tests.support.servers import ServerProcess, engine_server


# ---- the bookkeeping, over a fake K/V store whose copies can be checked --------------------------


class Store:
    """What each row's K/V "holds": the tokens written there, copied as the cache says."""

    def __init__(self, n_rows: int):
        self.kv = [[] for _ in range(n_rows)]
        self.copies: list[tuple[int, int, int]] = []

    def copy(self, src: int, dst: int, n: int) -> None:
        self.copies.append((src, dst, n))
        self.kv[dst] = list(self.kv[src][:n])


def run(rows, store: Store, slot: int, prompt: list[int], generated: int = 0) -> int:
    """Start `prompt` in `slot`, "prefill" the rest and decode `generated` tokens; returns cached."""
    from quantserve.server.prefix_cache import KVRows

    assert isinstance(rows, KVRows)
    row, cached = rows.start(slot, prompt)
    assert store.kv[row][:cached] == prompt[:cached]  # what the row holds is what it says
    store.kv[row] = store.kv[row][:cached] + prompt[cached:]
    rows.written(row, prompt[cached:], cached)
    for i in range(generated):
        store.kv[row].append(1000 + i)
        rows.written(row, [1000 + i], len(prompt) + i)
    assert rows.tokens[row] == store.kv[row]
    return cached


def make(n_rows: int, enabled: bool = True):
    from quantserve.server.prefix_cache import KVRows

    store = Store(n_rows)
    return KVRows(n_rows, store.copy, enabled), store


def test_a_new_prompt_starts_from_the_longest_cached_prefix_but_never_the_whole_prompt():
    rows, store = make(4)
    system = list(range(50))
    assert run(rows, store, 0, system + [100, 101]) == 0
    rows.release(0)
    assert run(rows, store, 1, system + [200, 201, 202]) == 50  # the shared system prompt
    assert run(rows, store, 2, system + [200, 201, 202]) == 52  # the same prompt: all but its last token
    assert rows.queried_tokens == 52 + 53 + 53 and rows.hit_tokens == 102


def test_a_live_sequences_tokens_are_matched_too_and_copied_to_the_new_row():
    rows, store = make(3)
    run(rows, store, 0, [1, 2, 3, 4, 5], generated=3)  # still running in row 0
    assert run(rows, store, 1, [1, 2, 3, 4, 5, 1000, 1001, 9]) == 7  # its reply so far is matched too
    assert store.copies == [(0, 1, 7)]


def test_reuse_finds_a_prefix_computed_after_admission():
    rows, store = make(2)
    a, _ = rows.start(0, [7] * 40 + [1])
    b, _ = rows.start(1, [7] * 40 + [2])  # admitted together: nothing cached yet
    store.kv[a] = [7] * 40 + [1]
    rows.written(a, [7] * 40 + [1], 0)
    assert rows.reuse(1, [7] * 40 + [2], 0) == 40
    assert store.kv[b] == [7] * 40


def test_the_cache_keeps_the_most_recent_finished_sequences():
    rows, store = make(3)
    for slot, first in enumerate((10, 20, 30)):  # three conversations, finished in this order
        run(rows, store, slot, [first] * 8)
    for slot in range(3):
        rows.release(slot)
    # a new, unrelated prompt takes row 0 (the lowest): 10's tokens are the oldest, so they go
    assert run(rows, store, 0, [40] * 8) == 0
    assert sorted(t[0] for t in rows.tokens if t) == [20, 30, 40]
    rows.release(0)
    # 20 is copied into row 0; what row 0 held (40, the newest) moves over the oldest (30)
    assert run(rows, store, 0, [20] * 9) == 8 and run(rows, store, 1, [40] * 9) == 8


def test_the_newest_finished_sequence_is_moved_away_from_the_lowest_row_not_lost():
    rows, store = make(3)
    run(rows, store, 0, [10] * 8)
    rows.release(0)  # row 0 holds the newest finished sequence, rows 1 and 2 nothing
    run(rows, store, 0, [40] * 8)  # takes row 0: its content moves to an empty row first
    assert store.copies == [(0, 1, 8)]
    assert run(rows, store, 1, [10] * 9) == 8


def test_disabled_the_cache_finds_nothing():
    rows, store = make(2, enabled=False)
    run(rows, store, 0, [1] * 10)
    rows.release(0)
    assert run(rows, store, 0, [1] * 10) == 0 and rows.hit_tokens == 0 and store.copies == []


def test_a_failed_forward_leaves_no_tokens_behind():
    """`written` follows a forward that succeeded: a row whose prefill failed holds only what it
    held before, so a later prompt never matches K/V that were not computed."""
    rows, store = make(2)
    row, cached = rows.start(0, [5] * 20)
    rows.release(0)  # the prefill failed: nothing was written
    assert run(rows, store, 0, [5] * 20) == 0


# ---- each real backend: cached K/V give the logits a cold prefill gives --------------------------


def _backends(default_model, tmp_path_factory):
    from quantserve.modeling import load_model
    from quantserve.server.backend import HFBackend
    from quantserve.server.fastcore.adapter import FastCoreBackend
    from quantserve.server.gguf_engine import load_gguf

    def gguf(prefix_cache):
        from quantserve.quant.convert import convert

        folder = convert(default_model, "gguf-f16", tmp_path_factory.mktemp("gguf-prefix") / "f16", progress=False)
        return load_gguf(next(folder.glob("*.gguf")), 512, 4, 8, threads=1, prefix_cache=prefix_cache)[0]

    return {"hf": lambda pc: HFBackend(load_model(default_model), 4, 512, prefix_cache=pc),
            "fast": lambda pc: FastCoreBackend(default_model, 4, 512, device="cpu", prefix_cache=pc),
            "gguf": gguf}


@pytest.mark.parametrize("kind", ["hf", "fast", "gguf"])
def test_cached_prefixes_give_the_logits_of_a_cold_prefill(kind, default_model, tmp_path_factory):
    make_backend = _backends(default_model, tmp_path_factory)[kind]
    rng = np.random.default_rng(0)
    system = rng.integers(5, 200, 60).tolist()
    first, second, third = (system + [201 + i] + rng.integers(5, 200, 6).tolist() for i in range(3))

    def greedy(backend, slot, prompt, steps=4):
        """Prefill what is not cached, then decode `steps` greedy tokens -> (cached, logits rows)."""
        cached = backend.start(slot, prompt)
        out = [np.asarray(backend.prefill(slot, prompt[cached:], cached), dtype=np.float32)]
        for _ in range(steps):
            out.append(np.asarray(backend.decode([slot], [int(out[-1].argmax())])[0], dtype=np.float32))
        return cached, out

    cold = make_backend(False)
    reference = {}
    for i, prompt in enumerate((first, second, third)):
        reference[i] = greedy(cold, 0, prompt)[1]
        cold.free(0)
    warm = make_backend(True)
    shared = _cacheable(kind, len(system))
    assert greedy(warm, 0, first)[0] == 0  # row 0 keeps running: `second` takes its prefix
    cached, out = greedy(warm, 1, second)
    assert cached == shared
    warm.free(0)
    warm.free(1)
    cached3, out3 = greedy(warm, 2, third)  # both finished: the most recent match is taken
    assert cached3 == shared
    tol = 1e-3 if kind != "gguf" else 2e-2
    for got, want in ((out, reference[1]), (out3, reference[2])):
        assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=tol, rtol=tol)
    assert warm.prefix_cache_stats()[1] == 2 * shared
    warm.free(2)
    assert warm.cached_tokens() == 0  # nothing live: finished rows are reclaimable, not "used"


def _cacheable(kind: str, n: int) -> int:
    """How much of an n-token shared prefix a backend takes from the cache: the fast engine's
    paged cache shares whole 16-token blocks (vLLM's granularity), the others any length."""
    return n // 16 * 16 if kind == "fast" else n


def test_short_prompt_pieces_in_one_forward_give_each_ones_own_logits(default_model):
    """The fast engine's one forward for several prompts: pieces of different lengths at different
    positions, after cached prefixes, give the logits each gets alone."""
    from quantserve.server.fastcore.adapter import FastCoreBackend

    rng = np.random.default_rng(1)
    system = rng.integers(5, 200, 40).tolist()
    prompts = [system + [201 + i] + rng.integers(5, 200, 3 + 5 * i).tolist() for i in range(3)]
    alone, together = (FastCoreBackend(default_model, 4, 256, device="cpu") for _ in range(2))
    want = []
    for slot, p in enumerate(prompts):
        want.append(np.asarray(alone.prefill(slot, p[:40])))  # the shared part, then the rest
        want[-1] = np.asarray(alone.prefill(slot, p[40:], 40))
    for slot, p in enumerate(prompts):
        assert together.start(slot, p) == (0 if slot == 0 else 32)  # two whole blocks of the 40 shared
        if slot == 0:
            together.prefill(0, p[:40])
    got = together.step([(slot, p[together.pool.held(slot):]) for slot, p in enumerate(prompts)]).cpu()
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, atol=1e-4, rtol=1e-4)
    nxt = [int(np.asarray(g).argmax()) for g in got]
    np.testing.assert_allclose(np.asarray(together.decode([0, 1, 2], nxt)), np.asarray(alone.decode([0, 1, 2], nxt)),
                               atol=1e-4, rtol=1e-4)


# ---- real servers ------------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant. Answer the question in as few words as you can, and never "
          "explain. " * 6)
QUESTIONS = ["Sort: d a c b", "What is 12 + 30?", "Repeat: k q m", "What comes after g?",
             "How many letters in: a b c", "What is the capital of Keltria?", "Sort: z y x", "What is 2 + 2?"]


@pytest.fixture(scope="module", params=["hf", "fast", "gguf"])
def server(request, default_model, tmp_path_factory):
    srv = engine_server(request.param, default_model, tmp_path_factory)
    yield srv
    assert srv.stop() == 0, srv.log()


def ask(client, question: str, history=()):
    messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    return r.choices[0].message.content, r.usage


def metric(srv, name: str) -> float:
    text = httpx.get(srv.base_url + "/metrics").text
    return float(re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.M).group(1))


def test_a_served_prefix_hit_answers_as_the_cold_request_did(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    whole = lambda n: _cacheable(server.health["engine"], n)  # noqa: E731
    hits_before = metric(server, "quantserve:prefix_cache_hits")
    cold, usage = ask(client, "A question nobody asked before: Sort: q w e")
    again, usage2 = ask(client, "A question nobody asked before: Sort: q w e")
    assert again == cold
    assert usage2.prompt_tokens_details.cached_tokens == whole(usage2.prompt_tokens - 1)
    assert usage.prompt_tokens_details.cached_tokens < whole(usage.prompt_tokens - 1)
    # a second turn starts with the whole first one: the first turn's prompt is cached
    _, usage3 = ask(client, "And now: Sort: c b a", [{"role": "user", "content": "A question nobody asked before: "
                                                       "Sort: q w e"}, {"role": "assistant", "content": cold}])
    assert usage3.prompt_tokens_details.cached_tokens >= whole(usage.prompt_tokens - 1)
    assert metric(server, "quantserve:prefix_cache_hits") > hits_before
    assert metric(server, "vllm:prefix_cache_queries") >= metric(server, "vllm:prefix_cache_hits") > 0


def test_concurrent_requests_sharing_a_system_prompt_answer_as_alone(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    alone = [ask(client, q)[0] for q in QUESTIONS]  # one at a time
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(client, q), QUESTIONS * 2))
    assert [text for text, _ in together] == alone * 2
    assert all(u.prompt_tokens_details.cached_tokens > 0 for _, u in together)
    assert metric(server, "quantserve:kv_cache_used_tokens") == 0  # all done: nothing live


def test_no_prefix_cache_computes_every_prompt(default_model, tmp_path_factory):
    srv = ServerProcess(default_model, "--engine", "hf", "--no-prefix-cache", name="default")
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
        first, _ = ask(client, QUESTIONS[0])
        second, usage = ask(client, QUESTIONS[0])
        assert second == first and usage.prompt_tokens_details.cached_tokens == 0
        assert metric(srv, "quantserve:prefix_cache_hits") == 0
    finally:
        assert srv.stop() == 0, srv.log()


def test_the_shared_prefix_load_generator_sees_the_cache(server, tmp_path):
    """bench/serve.py --shared-prefix-len: 8 users of one system text; the server's cached_tokens
    come back through the benchmark's own accounting."""
    import json

    from quantserve.bench import serve as bs

    out = tmp_path / "shared.json"
    assert bs.main(["--base-url", server.base_url + "/v1", "--chat", "--shared-prefix-len", "80", "--input-len", "4",
                    "--concurrency", "4", "--num-prompts", "8", "--output-len", "4", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == 8 and run["cached_tokens"] >= 7 * 80 // 2


def test_each_load_level_sends_prompts_no_earlier_level_sent(server, tmp_path):
    """bench/serve.py's concurrency levels draw fresh prompts: a level that re-sent an earlier
    level's prompts would find them in the server's cache and time cached prefills (an 8B run's
    c = 8 level had half its prompt tokens cached that way)."""
    import json

    from quantserve.bench import serve as bs

    out = tmp_path / "levels.json"
    assert bs.main(["--base-url", server.base_url + "/v1", "--input-len", "60", "--concurrency", "1,2",
                    "--num-prompts", "3", "--output-len", "2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["completed"] for r in runs] == [3, 3]
    # a prompt's first token (the BOS) may come from the cache; a repeated prompt would bring ~60
    assert all(r["cached_tokens"] <= r["completed"] for r in runs), runs
