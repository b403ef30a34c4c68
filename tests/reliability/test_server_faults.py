"""Fault injection into a running server, for real: a server out of memory under an address-space
limit, a decode step that fails, model files rewritten under it, clients killed mid-stream.  Each
test checks that nothing was lost and writes its figures to runs/reliability/server-faults.json
(tests/reliability/test_faults.py kills processes while they write files).

- out of memory: the request gets a 503 `out_of_memory`, the others keep being served.
- a failing decode step: an error reply (500, or an error event in a stream), never a short
  completion that looks successful.
- the served model file overwritten, truncated, deleted or replaced: the server is unaffected.
- clients SIGKILLed mid-stream, again and again: no slot or KV cache leaks.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import httpx
import openai
import psutil
import pytest

from tests.support.figures import FULL, Figures
from tests.support.servers import ServerProcess, collect_stream


@pytest.fixture(scope="module")
def figures():
    f = Figures("server-faults")
    yield f
    f.write()


def outcomes(srv: ServerProcess) -> dict[str, float]:
    text = httpx.get(srv.base_url + "/metrics").text
    return {o: float(line.rsplit(" ", 1)[1]) for o in ("success", "error", "disconnected", "rejected")
            for line in text.splitlines() if line.startswith(f'quantserve:request_outcome_total{{outcome="{o}"}}')}


# ---- c, d. out of memory and failing decode steps ----------------------------------------------------

def _stream_lines(url: str, body: dict) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=120)
    return client, client.send(client.build_request("POST", url, json=body), stream=True)


def _events(lines: list[str]) -> list[dict | str]:
    """The SSE data of a stream, parsed; "[DONE]" stays a string."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


# Address space the server may use beyond what it holds after warm-up.  A normal request needs a
# few MiB; 32 choices of a 470-token prompt hold 32 x 470 x 4 KiB = 59 MiB of KV cache, and the
# decode step that pads them into one batch as much again.  Measured: 32 to 64 MiB all behave the same.
OOM_MARGIN_MIB = 48
# 2 prompts x n=16 = 32 sequences of 471 tokens.  Prompts enter about one per step (chunked prefill),
# so each decodes 40 tokens (no early EOS) to overlap with the others and hit the limit together.
BIG = {"prompt": [[1] + [7] * 470] * 2, "n": 16, "max_tokens": 40, "ignore_eos": True}


def test_out_of_memory_is_a_503_and_the_others_keep_going(default_model, figures):
    srv = ServerProcess(default_model, "--max-batch", "32", "--max-queue", "64", name="tiny")
    try:
        url = srv.base_url + "/v1/completions"
        warm = httpx.post(url, json={"model": "tiny", "prompt": [[1] + [5] * 100] * 2, "n": 4, "max_tokens": 8},
                          timeout=120)
        assert warm.status_code == 200
        proc = psutil.Process(srv.proc.pid)
        vms = proc.memory_info().vms
        resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (vms + OOM_MARGIN_MIB * 2**20, resource.RLIM_INFINITY))
        try:
            # a small stream is running when the big request arrives
            client, small = _stream_lines(url, {"model": "tiny", "prompt": "Repeat: a b c", "max_tokens": 150,
                                                "ignore_eos": True, "temperature": 0, "stream": True,
                                                "stream_options": {"include_usage": True}})
            lines = small.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            # non-streaming: the OpenAI-style 503
            big = httpx.post(url, json={"model": "tiny", **BIG}, timeout=120)
            assert big.status_code == 503, big.text
            assert big.json()["error"]["code"] == "out_of_memory"
            assert big.json()["error"]["type"] == "service_unavailable"
            # streaming: an error event, then [DONE]
            big_client, big_stream = _stream_lines(url, {"model": "tiny", **BIG, "stream": True})
            assert big_stream.status_code == 200
            big_events = _events(list(big_stream.iter_lines()))
            big_client.close()
            errors = [e for e in big_events if isinstance(e, dict) and "error" in e]
            assert errors and errors[0]["error"]["code"] == "out_of_memory" and big_events[-1] == "[DONE]"
            # the small stream went on undisturbed, to its last token
            small_events = _events([first, *lines])
            client.close()
            assert small_events[-1] == "[DONE]" and not any("error" in e for e in small_events[:-1])
            assert small_events[-2]["usage"]["completion_tokens"] == 150
            assert small_events[-3]["choices"][0]["finish_reason"] == "length"
            # and new requests are served, under the same limit
            after = srv.client().completions.create(model="tiny", prompt="What is 1 + 1?", max_tokens=8)
            assert after.choices[0].finish_reason in ("stop", "length")
            m = srv.wait_idle()
            log = srv.log_path.read_text()
        finally:
            resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert m["quantserve:kv_cache_used_tokens"] == 0 and m["quantserve:num_requests_running"] == 0
        counted = outcomes(srv)
        assert counted["error"] == 2 and srv.proc.poll() is None
    finally:
        assert srv.stop() == 0, srv.log()
    shed = log.count("shedding request")
    figures.add("out of memory (RLIMIT_AS = post-warm-up VM size + 48 MiB, 32 x 471-token sequences)",
                f"2 requests (plain, streaming) got 503 out_of_memory; {shed} sequences shed, "
                f"{len(errors)} error events in the stream")
    figures.add("out of memory: the others", "a 150-token stream running alongside finished all 150 tokens; "
                "a new request afterwards succeeded; KV cache and batch back to 0; server alive")


def test_a_failing_decode_step_is_an_error_reply_not_a_short_completion(default_model, monkeypatch, figures):
    # decode steps 3, 8 and 13 fail (server/scheduler.py: _FaultyDecode says why this one is injected)
    monkeypatch.setenv("QUANTSERVE_FAULT_DECODE_STEPS", "3,8,13")
    srv = ServerProcess(default_model, "--max-batch", "4", name="tiny")
    try:
        client = srv.client()
        body = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        chat = dict(model="tiny", messages=[{"role": "user", "content": "Count from 1 to 9."}], max_tokens=10,
                    temperature=0, stream=True)
        # decode steps 1-3: the third fails after 3 tokens
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(prompt="Repeat: a b c", **body)
        assert e.value.status_code == 500 and e.value.body["code"] == "engine_error"
        assert "decode step 3 failed" in e.value.body["message"]
        # steps 4-8: a stream gets its first tokens, then an error event instead of a finish_reason
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60,
                          json={**chat, "ignore_eos": True}) as r:
            events = _events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        assert sum(1 for e in events[:-2] if e["choices"][0]["delta"].get("content")) >= 1
        assert not any(e["choices"][0].get("finish_reason") for e in events[:-2])
        # steps 9-13: the official client raises on that event rather than returning a short text
        with pytest.raises(openai.APIError) as e:
            collect_stream(client.chat.completions.create(**chat, extra_body={"ignore_eos": True}))
        assert e.value.body["code"] == "engine_error"
        # steps 14 on: served as usual
        ok = client.completions.create(prompt="Repeat: a b c", **body)
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 10
        srv.wait_idle()
        counted = outcomes(srv)
        assert counted["error"] == 3 and counted["success"] == 1
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add("decode step failed (injected at steps 3, 8, 13)",
                "non-streaming: 500 engine_error; streaming: tokens, then an error event, then [DONE] "
                "(no finish_reason), which the openai client raises as APIError; the next request succeeded")


# ---- e. the model file changed under a running server ------------------------------------------------

PROMPTS = ["Repeat: k q m", "What is 12 + 30?", "Sort: d a c b"]


def _greedy(srv: ServerProcess) -> list[str]:
    client = srv.client()
    return [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]


@pytest.mark.parametrize("engine", ["hf", "gguf"])
def test_model_file_changed_under_a_running_server(engine, default_model, tmp_path, figures):
    if engine == "hf":
        served = shutil.copytree(default_model, tmp_path / "model")
        weights = served / "model.safetensors"
    else:
        from quantserve.quant.convert import convert

        served = convert(default_model, "gguf-q8_0", tmp_path / "model", progress=False) / "model.gguf"
        weights = served
    srv = ServerProcess(served, "--max-batch", "4", name="tiny")
    survived = []
    try:
        expected = _greedy(srv)
        size = weights.stat().st_size

        def overwrite_in_place():  # as `cp other.file model` does: same inode, new bytes
            with open(weights, "r+b") as f:
                f.write(os.urandom(size))

        def truncate_in_place():
            os.truncate(weights, 0)

        def delete():
            weights.unlink()

        def replace_by_rename():  # as `quant convert --force` does: a new inode under the old name
            fresh = weights.with_name(weights.name + ".new")
            fresh.write_bytes(os.urandom(size))
            fresh.rename(weights)

        for fault in (overwrite_in_place, truncate_in_place, delete, replace_by_rename):
            fault()
            assert _greedy(srv) == expected, fault.__name__
            assert srv.proc.poll() is None and httpx.get(srv.base_url + "/health").status_code == 200
            survived.append(fault.__name__)
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add(f"{engine} engine: weights file {', '.join(survived)} while serving",
                f"{len(survived)} of 4 survived; greedy outputs unchanged (weights read into memory at load, "
                "no mmap of the file)")


# ---- f. clients killed mid-stream --------------------------------------------------------------------

CLIENT = """
import sys, httpx
with httpx.stream("POST", sys.argv[1], timeout=60, json={"model": "tiny", "prompt": "Repeat: a b c",
        "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("streaming", flush=True)
            sys.stdin.read()  # hold the stream open until killed
"""


def test_clients_killed_mid_stream_leak_no_slot(default_model, figures):
    kills = 40 if FULL else 10
    srv = ServerProcess(default_model, "--max-batch", "2", "--max-queue", "2", name="tiny")
    try:
        before = srv.metrics()
        for _ in range(kills):
            client = subprocess.Popen([sys.executable, "-c", CLIENT, srv.base_url + "/v1/completions"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert client.stdout.readline().strip() == "streaming"
            client.kill()
            client.wait()
        m = srv.wait_idle()
        assert (m["quantserve:num_requests_running"], m["quantserve:kv_cache_used_tokens"]) == (0, 0)
        cancelled = (m["quantserve:engine_cancelled_requests_total"]
                     - before["quantserve:engine_cancelled_requests_total"])
        assert cancelled == kills
        # every slot is free again: requests are served as usual
        client = srv.client()
        for _ in range(4):
            r = client.completions.create(model="tiny", prompt="hi", max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
        assert outcomes(srv)["disconnected"] == kills
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add("client processes SIGKILLed mid-stream (max-batch 2)",
                f"{kills} kills; {cancelled:.0f} generations cancelled, 0 slots or KV tokens leaked")
    figures.add("client disconnects in the soak", "see runs/reliability/soak.json (mid-stream, after headers, "
                "before any reply; slots and KV cache back to 0)")
