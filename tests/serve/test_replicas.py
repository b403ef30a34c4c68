"""`quantserve serve --replicas`: two copies of the server placed by Ray Serve, on the CPU, for real.

One local Ray cluster per fixture (it starts in ~10 s here); the default model, the official
client.  Which replica answered is read from the `x-quantserve-replica` header; replica processes
are found by the title Ray gives them (`ray::ServeReplica:quantserve-<tag>:model`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.support.figures import Figures
from tests.support.servers import ServerProcess, replica_pids

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray", reason="Ray Serve is the 'replicas' extra (make install installs it)")

PROMPTS = ["Sort:\nd b a", "Repeat: k l m", "How many letters?\nq w e r", "What is 12 + 30?",
           "Next letter after f?", "Sort:\nz y", "Repeat: a", "What is 3 + 4?"]


def ask(base_url: str, prompt: str, session: str | None = None, user: str | None = None, timeout: float = 60):
    """(answer, replica id) of one greedy chat request."""
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "temperature": 0}
    if user:
        body["user"] = user
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"], r.headers["x-quantserve-replica"]


@pytest.fixture(scope="module")
def figures():
    """The fault test's figures, in runs/reliability/replicas.json (`make reliability`'s table)."""
    f = Figures("replicas")
    yield f
    if f.rows:
        f.write()


@pytest.fixture(scope="module")
def single(default_model):
    srv = ServerProcess(default_model, "--engine", "hf", name="default")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def two(default_model):
    srv = ServerProcess(default_model, "--engine", "hf", "--replicas", "2", "--routing", "session",
                        "--max-batch", "4", name="default", start_timeout=240)
    yield srv
    assert srv.stop(timeout=90) == 0, srv.log()


def test_answers_match_a_single_server_and_spread_over_both(two, single):
    want = [single.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": p}], max_tokens=8, temperature=0).choices[0].message.content
        for p in PROMPTS]
    seen = set()
    for _ in range(2):
        for prompt, expected in zip(PROMPTS, want):
            answer, replica = ask(two.base_url, prompt)
            assert answer == expected, prompt
            seen.add(replica)
    assert len(seen) == 2, seen  # requests without a session are spread
    # the official client, streamed, through the gateway
    stream = two.client().chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want[0]


def test_a_session_stays_on_one_replica(two):
    for session in ("alice", "bob", "carol"):
        replicas = {ask(two.base_url, p, session=session)[1] for p in PROMPTS}
        assert len(replicas) == 1, (session, replicas)
    users = {ask(two.base_url, p, user="dave")[1] for p in PROMPTS}  # the body's `user` when no header
    assert len(users) == 1, users


def test_errors_pass_through_as_they_are(two):
    r = httpx.post(two.base_url + "/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(two.base_url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # a body nested past the JSON parser's depth, read by the gateway for session routing: a 400 too
    r = httpx.post(two.base_url + "/v1/chat/completions", content=b"[" * 100_000, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    # /metrics is every replica's page, each sample labelled: a scrape never switches replica
    metrics = httpx.get(two.base_url + "/metrics", timeout=30).text
    assert "vllm:num_requests_waiting" in metrics and "quantserve:num_requests_running" in metrics
    running = [ln for ln in metrics.splitlines() if ln.startswith("quantserve:num_requests_running{")]
    assert len({ln.split('replica="')[1].split('"')[0] for ln in running}) == 2, running
    assert sum(ln.startswith("# TYPE quantserve:num_requests_running ") for ln in metrics.splitlines()) == 1


def test_a_killed_replica_loses_no_request(two, figures):
    """SIGKILL one replica under load: non-streamed requests are retried on the other, streams
    finish or end with an error event, and Ray Serve brings a second replica back."""
    before = replica_pids()
    assert len(before) == 2, before
    stop = threading.Event()
    results = {"ok": 0, "failed": [], "streams_ok": 0, "streams_error_event": 0, "streams_failed": []}
    lock = threading.Lock()

    def plain(i: int) -> None:
        while not stop.is_set():
            try:
                ask(two.base_url, PROMPTS[i % len(PROMPTS)], timeout=90)
                with lock:
                    results["ok"] += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                with lock:
                    results["failed"].append(repr(e)[:200])

    def streamed() -> None:
        while not stop.is_set():
            body = {"model": "default", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 64,
                    "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", two.base_url + "/v1/chat/completions", json=body, timeout=90) as r:
                    events = [line for line in r.iter_lines() if line.startswith("data: ")]
                done = events and events[-1] == "data: [DONE]"
                errored = any('"error"' in e for e in events)
                with lock:
                    if done and not errored:
                        results["streams_ok"] += 1
                    elif errored:
                        results["streams_error_event"] += 1
                    else:
                        results["streams_failed"].append(f"ended without [DONE] or an error: {events[-1:]}")
            except Exception as e:  # noqa: BLE001
                with lock:
                    results["streams_failed"].append(repr(e)[:200])

    workers = [threading.Thread(target=plain, args=(i,)) for i in range(4)] + [threading.Thread(target=streamed)]
    for w in workers:
        w.start()
    time.sleep(3)
    victim = before[0]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    recovered = None
    while time.monotonic() - killed_at < 120:
        pids = replica_pids()
        if len(pids) == 2 and victim not in pids:
            try:
                if httpx.get(two.base_url + "/health", timeout=5).status_code == 200:
                    replicas = {ask(two.base_url, p)[1] for p in PROMPTS * 2}
                    if len(replicas) == 2:
                        recovered = time.monotonic() - killed_at
                        break
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    time.sleep(2)
    stop.set()
    for w in workers:
        w.join(120)
    print("\nkilled replica:", json.dumps({**results, "recovered_s": recovered}))
    plain_total = results["ok"] + len(results["failed"])
    streams = results["streams_ok"] + results["streams_error_event"] + len(results["streams_failed"])
    figures.add("--replicas 2 (hf engine, default model): one replica SIGKILLed under 4 looping clients "
                "and a streaming one; non-streamed requests",
                f"{plain_total} sent, {len(results['failed'])} failed (those on the killed replica retried on the other)")
    figures.add("the same: streams", f"{streams} sent, {results['streams_ok']} complete, {results['streams_error_event']} "
                f"ended with an error event, {len(results['streams_failed'])} broken")
    figures.add("the same: seconds from the kill to two replicas answering again",
                f"{recovered:.1f}" if recovered is not None else "not within 120")
    assert not results["failed"], results["failed"][:3]
    assert not results["streams_failed"], results["streams_failed"][:3]
    assert results["ok"] > 10 and results["streams_ok"] + results["streams_error_event"] >= 1
    assert recovered is not None, "the killed replica did not come back within 120 s"


def test_routing_least_loaded_in_turn_and_sessions_by_rendezvous():
    """The gateway's choice of replica (no Ray, no model): ties go in turn, the least loaded
    first; a session keeps its replica while it is up, and only its sessions move when it goes."""
    from quantserve.server.gateway import Routes

    routes = Routes("least-loaded")
    routes.update({"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"})
    assert {routes.pick(None, set()).id for _ in range(2)} == {"a", "b"}  # idle: in turn
    routes.replicas["a"].inflight = 3
    assert all(routes.pick(None, set()).id == "b" for _ in range(4))
    assert routes.pick(None, {"b"}).id == "a"  # a retry goes elsewhere
    routes.replicas["a"].down_until = float("inf")  # failed a while ago: passed over ...
    assert all(routes.pick(None, set()).id == "b" for _ in range(4))
    assert routes.pick(None, {"b"}).id == "a"  # ... unless b just failed too
    routes.update({"b": "http://127.0.0.1:2"})
    assert list(routes.replicas) == ["b"] and routes.replicas["b"].inflight == 0
    assert routes.pick(None, {"b"}).id == "b"  # nothing else: the one that failed, once more

    sessions = Routes("session")
    sessions.update({r: f"http://127.0.0.1:{i}" for i, r in enumerate("abc")})
    home = {s: sessions.pick(s, set()).id for s in map(str, range(60))}
    assert set(home.values()) == {"a", "b", "c"}  # sessions spread
    assert all(sessions.pick(s, set()).id == r for s, r in home.items())  # and stay
    sessions.replicas["c"].down_until = float("inf")  # c fails: only its sessions move
    moved = {s: sessions.pick(s, set()).id for s in home}
    assert all(moved[s] == r for s, r in home.items() if r != "c") and "c" not in moved.values()
    sessions.update({"a": "http://127.0.0.1:0", "b": "http://127.0.0.1:1"})
    assert {s: sessions.pick(s, set()).id for s in home} == moved
    assert Routes("least-loaded").pick(None, set()) is None


def test_the_gateway_checks_the_api_key_before_reading_a_body(default_model):
    """With --api-key, the gateway answers 401 itself (no body is relayed without the key); the
    key works through it, /health stays open."""
    key = "sk-gw-5e1"
    srv = ServerProcess(default_model, "--engine", "hf", "--replicas", "1", api_key=key, name="default",
                        start_timeout=240)
    try:
        r = httpx.post(srv.base_url + "/v1/chat/completions", content=b"x" * 1000, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "x-quantserve-replica" not in r.headers  # the gateway's own answer
        ok = srv.client().chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
    finally:
        assert srv.stop(timeout=90) == 0, srv.log()
