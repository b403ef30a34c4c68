"""API fuzzing from the server's own OpenAPI schema (schemathesis), against a real server process.

Every endpoint gets bodies (and path parameters) that fit the schema and, where the schema leaves
anything to break, bodies that do not; the POST endpoints also get raw bytes, arbitrary JSON and
field swaps.  For each answer: never a 5xx, a 4xx in the OpenAI error shape, a 2xx that parses as
the endpoint's response (streams end with [DONE] and carry no error), and no hang.  Afterwards the
server must be as healthy as before: same greedy completion, nothing left running, no traceback.

Size: `QUANTSERVE_RELIABILITY=quick` (default) or `full`; figures go to runs/reliability/fuzz.json.
"""

from __future__ import annotations

import collections
import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from tests.support.figures import SIZE, Figures
from tests.support.http import assert_openai_error
from tests.support.servers import ServerProcess

MODEL = "tiny"
CONTEXT = 128  # small, so a valid body that asks for "as many tokens as fit" stays quick
SMALL_MAX_TOKENS = 6  # valid bodies aimed at the model generate at most this many tokens per choice
REQUEST_TIMEOUT = 30.0  # seconds; no request may take longer (a hang fails the test)
EXAMPLES = {"quick": {"schema": 120, "raw": 60}, "full": {"schema": 1500, "raw": 1000}}[SIZE]

ENDPOINTS = ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
             "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings", "POST /v1/responses",
             "POST /tokenize", "POST /detokenize"]
# negative cases only where the schema has something to break: a body (any string is a valid
# model id, and the other GETs take nothing)
CASES = [(label, "positive") for label in ENDPOINTS] + \
    [(label, "negative") for label in ENDPOINTS if label.startswith("POST")]

# what was sent and what came back: (operation, kind) -> Counter of status codes
SENT: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
SLOWEST = [0.0]


@pytest.fixture(scope="module")
def server(default_model):
    started = time.perf_counter()
    srv = ServerProcess(default_model, "--context", str(CONTEXT), "--max-batch", "16", "--max-queue", "512",
                        name=MODEL)
    srv.baseline = _greedy(srv)
    yield srv
    code = srv.stop()
    _write_figures(time.perf_counter() - started)
    assert code == 0, srv.log()


@pytest.fixture(scope="module")
def schema(default_model):
    """The served app's own OpenAPI document (the app serves none: built here from its routes)."""
    from quantserve.server.api_server import create_app
    from quantserve.server.engines import EngineOptions, ScheduledEngine

    app = create_app(ScheduledEngine(default_model, EngineOptions()), MODEL)  # nothing loads until start-up
    return schemathesis.openapi.from_dict(app.openapi())


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=REQUEST_TIMEOUT) as c:
        yield c


def _greedy(srv) -> str:
    r = srv.client().completions.create(model=MODEL, prompt="Repeat: a b c", max_tokens=8, temperature=0)
    return r.choices[0].text


def _operations(schema) -> dict:
    return {result.ok().label: result.ok() for result in schema.get_all_operations()}


def test_the_schema_lists_every_endpoint(schema):
    # a new route must be added to ENDPOINTS (and so to the fuzzing) before this passes
    assert sorted(_operations(schema)) == sorted(ENDPOINTS)


# ---- sending and checking one request ------------------------------------------------------------


def _aim(case, label: str) -> None:
    """Point a generated case at the served model with a small token budget, so it reaches the
    engine instead of stopping at 404 model_not_found, and generation stays quick."""
    if label == "GET /v1/models/{model_id}":
        case.path_parameters = {**(case.path_parameters or {}), "model_id": MODEL}
        return
    body = case.body
    if not isinstance(body, dict):
        return
    body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= CONTEXT:
            body[key] = min(value, SMALL_MAX_TOKENS)  # over the context stays: it must give a clean 400
    if label == "POST /v1/chat/completions" and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = SMALL_MAX_TOKENS  # chat's default is "all the context left", times n
    if label == "POST /v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = SMALL_MAX_TOKENS


def _send(client: httpx.Client, base_url: str, case) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url=base_url)
    request = client.build_request(kw["method"], kw["url"], headers=kw.get("headers"), params=kw.get("params"),
                                   json=kw["json"] if "json" in kw else None,
                                   content=kw.get("data") if "json" not in kw else None)
    return client.send(request)


def _check(label: str, kind: str, response: httpx.Response, elapsed: float, body) -> None:
    SENT[(label, kind)][response.status_code] += 1
    SLOWEST[0] = max(SLOWEST[0], elapsed)
    where = f"{label} ({kind}) -> {response.status_code}\nbody: {str(body)[:600]}\nanswer: {response.text[:600]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        assert_openai_error(response)
        return
    assert response.status_code == 200, where
    _check_success(label, response, body)


def _check_success(label: str, r: httpx.Response, body) -> None:
    from quantserve.server.protocol_replies import ChatCompletion, ChatCompletionChunk, Completion, ModelCard, ModelList

    if label == "GET /metrics":
        assert "quantserve:num_requests_running" in r.text
        return
    if r.headers["content-type"].startswith("text/event-stream") and label == "POST /v1/responses":
        events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), r.text[-500:]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        chunk_type = Completion if label == "POST /v1/completions" else ChatCompletionChunk
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for event in events[:-1]:
            data = json.loads(event)
            assert "error" not in data, f"error inside a stream: {event}\nbody: {str(body)[:600]}"
            chunk_type.model_validate(data)
        return
    data = r.json()
    if label == "GET /health":
        assert data["status"] == "ok"
    elif label == "GET /v1/models":
        assert [m.id for m in ModelList.model_validate(data).data] == [MODEL]
    elif label == "GET /v1/models/{model_id}":
        assert ModelCard.model_validate(data).id == MODEL
    elif label == "POST /v1/completions":
        out = Completion.model_validate(data)
        assert out.choices and out.usage and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    elif label == "POST /v1/chat/completions":
        out = ChatCompletion.model_validate(data)
        assert out.choices and all(c.finish_reason in ("stop", "length") for c in out.choices)
    elif label == "POST /v1/embeddings":
        assert data["object"] == "list" and data["data"] and data["usage"]["prompt_tokens"] > 0
    elif label == "POST /v1/responses":
        assert data["object"] == "response" and data["status"] in ("completed", "incomplete")
    elif label == "POST /tokenize":
        assert data["count"] == len(data["tokens"]) and all(isinstance(t, int) for t in data["tokens"])
    elif label == "POST /detokenize":
        assert isinstance(data["prompt"], str)


def _fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False)


# ---- schema-driven cases -------------------------------------------------------------------------


@pytest.mark.parametrize("label, mode", CASES)
def test_schema_fuzz(server, schema, client, label, mode):
    operation = _operations(schema)[label]
    strategy = operation.as_strategy(schemathesis.GenerationMode(mode))

    @_fuzz_settings(EXAMPLES["schema"])
    @given(case=strategy, aim=st.sampled_from([True, True, True, False]))
    def run(case, aim):
        if aim:
            _aim(case, label)
        t0 = time.perf_counter()
        response = _send(client, server.base_url, case)
        _check(label, mode, response, time.perf_counter() - t0, case.body)

    run()


# ---- raw bodies the schema cannot describe -------------------------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=20)
_TEMPLATES = {
    "POST /v1/completions": {"model": MODEL, "prompt": "Repeat: a b", "max_tokens": 2},
    "POST /v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "POST /tokenize": {"model": MODEL, "prompt": "a b c"},
    "POST /detokenize": {"model": MODEL, "tokens": [5, 6, 7]},
}


@st.composite
def _raw_bodies(draw, template: dict) -> bytes:
    """Bytes, any JSON, or a valid body with one field swapped for any JSON value."""
    kind = draw(st.sampled_from(["bytes", "json", "swap", "swap"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(_JSON)).encode()
    body = dict(template)
    body[draw(st.sampled_from(sorted(template)) | st.text(max_size=8))] = draw(_JSON)
    return json.dumps(body).encode()  # NaN and Infinity written as such, as Python's json does


@pytest.mark.parametrize("label", sorted(_TEMPLATES))
def test_raw_body_fuzz(server, client, label):
    path = label.split(" ", 1)[1]

    @_fuzz_settings(EXAMPLES["raw"])
    @given(content=_raw_bodies(_TEMPLATES[label]))
    def run(content):
        t0 = time.perf_counter()
        response = client.post(server.base_url + path, content=content, headers={"Content-Type": "application/json"})
        _check(label, "raw", response, time.perf_counter() - t0, content)

    run()


# ---- afterwards ----------------------------------------------------------------------------------


def test_the_server_is_healthy_afterwards(server):
    assert sum(sum(c.values()) for c in SENT.values()) > 0, "nothing was fuzzed"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert _greedy(server) == server.baseline  # same answer as before the fuzzing: no state leaked
    m = server.wait_idle(10)
    assert m["quantserve:num_requests_running"] == 0 and m["quantserve:kv_cache_used_tokens"] == 0, m
    log = server.log_path.read_text()  # all of it (log() keeps only the tail)
    assert "Traceback" not in log and "ERROR" not in log, log[-4000:]


def _write_figures(seconds: float) -> None:
    figures = Figures("fuzz")
    total = five = 0
    for label in ENDPOINTS:
        counts = {kind: sum(SENT[(label, kind)].values()) for kind in ("positive", "negative", "raw")}
        statuses = collections.Counter()
        for kind in counts:
            statuses.update(SENT[(label, kind)])
        sent = sum(counts.values())
        errors = sum(n for status, n in statuses.items() if status >= 500)
        total, five = total + sent, five + errors
        detail = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
        figures.add(f"{label}: requests sent", f"{sent} ({detail})" if sent else "0")
        figures.add(f"{label}: status codes", ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())) or "-")
    figures.add("requests sent, all endpoints", total)
    figures.add("5xx answers", five)
    figures.add("slowest answer (s)", f"{SLOWEST[0]:.2f} (limit {REQUEST_TIMEOUT:.0f})")
    figures.add("wall time incl. server start (s)", f"{seconds:.1f}")
    figures.write()
