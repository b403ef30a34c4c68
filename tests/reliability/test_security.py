"""Security properties of `quantserve serve`, each on a real server process or the real CLI:

(a) the API key is checked on every /v1 route and never appears in logs, even at debug level;
(b) request bodies over the limit get 413, with or without Content-Length (chunked);
(c) only the model registered at start-up is reachable, by its served name only;
(d) only safetensors / GGUF weights load: pickle checkpoints are refused unless --trust-pickle;
(e) the server binds 127.0.0.1 unless told otherwise;
(f) CORS is off unless --cors-origin allows an origin.

Figures go to runs/reliability/security.json.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
from urllib.parse import quote

import httpx
import pytest

from tests.support.figures import Figures
from tests.support.http import assert_openai_error, raw_http
from tests.support.cli import assert_one_line_error, cli
from tests.support.servers import ServerProcess

KEY = "sk-sec-7d1e9b44c0a2f3"
WRONG_KEYS = ["sk-sec-7d1e9b44c0a2f4", "sk-sec-7d1e9b44c0a2f", KEY + "0", "sk-" + "x" * 200]
ORIGIN = "https://app.example.com"
EVIL = "https://evil.example.net"
BODY_LIMIT = 65536
MODEL = "tiny"

FIGURES = Figures("security")


@pytest.fixture(scope="module", autouse=True)
def _figures():
    yield
    FIGURES.write()


@pytest.fixture(scope="module")
def keyed(default_model):
    """A server with a key (on the command line), debug logging, CORS for one origin, a small body limit."""
    srv = ServerProcess(default_model, "--api-key", KEY, "--log-level", "debug", "--cors-origin", ORIGIN,
                        "--max-body-bytes", str(BODY_LIMIT), "--context", "128", name=MODEL)
    srv.api_key = KEY
    yield srv
    srv.stop()


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(key: str | None = KEY) -> dict:
    return {"json": {"model": MODEL, "messages": [{"role": "user", "content": "What is 1 + 1?"}], "max_tokens": 2},
            "headers": _auth(key) if key is not None else {}}


# ---- (a) API key ----------------------------------------------------------------------------------


def test_api_key_guards_every_v1_route(keyed):
    import openai

    base = keyed.base_url
    routes = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
              ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", _chat()["json"]),
              ("POST", "/tokenize", {"model": MODEL, "prompt": "a"}),
              ("POST", "/detokenize", {"model": MODEL, "tokens": [5]})]
    refused = 0
    for method, path, body in routes:
        variants = [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer  {KEY}"},
                    {"Authorization": f"Bearer{KEY}"}, {"X-API-Key": KEY}] + [_auth(k) for k in WRONG_KEYS]
        for headers in variants:
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            assert_openai_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text and all(k not in r.text for k in WRONG_KEYS)
            refused += 1
        # nor in the query string
        assert httpx.request(method, base + path, json=body, params={"api_key": KEY}, timeout=30).status_code == 401
        refused += 1
        assert httpx.request(method, base + path, json=body, headers=_auth(), timeout=30).status_code == 200
        # the scheme's name is case-insensitive (RFC 9110 11.1)
        assert httpx.request(method, base + path, json=body, headers={"Authorization": f"bEARER {KEY}"},
                             timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key=WRONG_KEYS[0]).chat.completions.create(model=MODEL, messages=_chat()["json"]["messages"])
    assert keyed.client().chat.completions.create(model=MODEL, messages=_chat()["json"]["messages"],
                                                  max_tokens=2).choices
    # probes stay open
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
    FIGURES.add("requests with a missing, wrong or misplaced key (all 401)", refused)


def test_api_key_comparison_is_constant_time():
    # timing cannot be measured reliably on a shared CPU; the check is that the comparison is
    # hmac.compare_digest over bytes, not ==
    import inspect

    from quantserve.server.middleware import APIKeyMiddleware

    source = inspect.getsource(APIKeyMiddleware.__call__)
    assert "hmac.compare_digest(" in source and "==" not in source


def test_key_is_not_shown_by_help_and_trace_logging_is_refused():
    proc = cli("serve", "--help", env={"QUANTSERVE_API_KEY": KEY})
    assert proc.returncode == 0 and "--api-key" in proc.stdout and KEY not in proc.stdout + proc.stderr
    # uvicorn's trace level would log the Authorization header
    assert_one_line_error(cli("serve", "default", "--log-level", "trace"), 2, "--log-level")


# ---- (b) body size limit ---------------------------------------------------------------------------


def _padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (spaces are valid JSON)."""
    head = b'{"model": "tiny", "prompt": "a", "max_tokens": 2}'
    return head[:-1] + b" " * (size - len(head)) + b"}"


def test_body_limit_with_and_without_content_length(keyed):
    port = keyed.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: Bearer " \
        + KEY.encode()
    at_limit, over = _padded(BODY_LIMIT), _padded(BODY_LIMIT + 1)
    cases = [
        ("Content-Length, at the limit", head + b"\r\nContent-Length: %d" % len(at_limit), at_limit, 200),
        ("Content-Length, 1 byte over", head + b"\r\nContent-Length: %d" % len(over), over, 413),
        ("Content-Length claims 1 TB", head + b"\r\nContent-Length: 1000000000000", b"{}", 413),
        ("chunked, at the limit", head, [at_limit[i:i + 4096] for i in range(0, len(at_limit), 4096)], 200),
        ("chunked, 1 byte over", head, [over[i:i + 4096] for i in range(0, len(over), 4096)], 413),
        ("chunked, 1000 tiny chunks over", head, [b" " * 100] * 1000, 413),
        ("chunked, 16 MB", head, [b" " * (1 << 20)] * 16, 413),
    ]
    for name, request_head, body, status in cases:
        r = raw_http(port, request_head, body)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        if status == 413:
            assert_openai_error(r, 413, "request_too_large")
    assert httpx.get(keyed.base_url + "/health").status_code == 200
    FIGURES.add("body-limit cases (Content-Length and chunked)", f"{len(cases)} passed")


# ---- (c) only the registered model ---------------------------------------------------------------


def test_only_the_registered_model_is_reachable(keyed, default_model):
    base = keyed.base_url
    listed = httpx.get(base + "/v1/models", headers=_auth()).json()["data"]
    assert [m["id"] for m in listed] == [MODEL]
    # names a server that loaded models by path would accept: its folder, its path, other paths
    names = [default_model.name, str(default_model), str(default_model / "config.json"), "default",
             "gpt-4", "../tiny", "tiny ", "Tiny", "/etc/passwd", "tiny\x00"]
    checked = 0
    for name in names:
        for path, body in [("/v1/completions", {"model": name, "prompt": "a", "max_tokens": 2}),
                           ("/v1/chat/completions", {**_chat()["json"], "model": name}),
                           ("/tokenize", {"model": name, "prompt": "a"}),
                           ("/detokenize", {"model": name, "tokens": [5]})]:
            r = httpx.post(base + path, json=body, headers=_auth())
            error = assert_openai_error(r, 404, "model_not_found")
            assert error["param"] == "model" and error["type"] == "not_found_error"
            checked += 1
        r = httpx.get(base + "/v1/models/" + quote(name, safe=""), headers=_auth())
        assert_openai_error(r, 404, "model_not_found")
        checked += 1
    FIGURES.add("unknown or path-like model names (all 404 model_not_found)", checked)


# ---- (d) pickle weights ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pickle_checkpoint(default_model, tmp_path_factory):
    """The default model with its weights as pytorch_model.bin (a pickle) and no safetensors."""
    import torch
    from safetensors.torch import load_file

    folder = tmp_path_factory.mktemp("pickled") / "pickled-model"
    folder.mkdir()
    torch.save(load_file(default_model / "model.safetensors"), folder / "pytorch_model.bin")
    for f in default_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, folder / f.name)
    return folder


def test_pickle_checkpoints_are_refused_with_one_line(pickle_checkpoint, tmp_path):
    refused = 0
    proc = cli("serve", str(pickle_checkpoint), "--port", "1")
    assert_one_line_error(proc, 1, "pickle", "pytorch_model.bin", "--trust-pickle")
    refused += 1
    assert_one_line_error(cli("generate", "hi", "--model", str(pickle_checkpoint)), 1, "pickle")
    refused += 1
    for name in ("model.pt", "weights.pth", "last.ckpt"):
        other = tmp_path / name.split(".")[0]
        other.mkdir()
        shutil.copy2(pickle_checkpoint / "config.json", other / "config.json")
        shutil.copy2(pickle_checkpoint / "pytorch_model.bin", other / name)
        assert_one_line_error(cli("serve", str(other), "--port", "1"), 1, "pickle", name)
        assert_one_line_error(cli("serve", str(other / name), "--port", "1"), 1, "pickle")
        refused += 2
    quant = "import sys; from quantserve.quant.cli import main; sys.argv[0] = 'quant'; main()"
    proc = subprocess.run([sys.executable, "-c", quant, "convert", str(pickle_checkpoint), "--format", "gguf-f16",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, 1, "pickle")
    refused += 1
    FIGURES.add("pickle checkpoints refused without --trust-pickle (serve, generate, quant convert)", refused)


@pytest.fixture(scope="module")
def trusted(pickle_checkpoint):
    """The pickle checkpoint served with --trust-pickle; no key, no CORS, default host."""
    srv = ServerProcess(pickle_checkpoint, "--trust-pickle", "--context", "128", name=MODEL)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_trust_pickle_serves_the_same_model(trusted, keyed):
    kw = dict(model=MODEL, prompt="Repeat: a b c", max_tokens=8, temperature=0)
    assert trusted.client().completions.create(**kw).choices[0].text == \
        keyed.client().completions.create(**kw).choices[0].text
    assert "trusted pickle weights" in trusted.log()  # the choice is logged
    FIGURES.add("pickle checkpoint served with --trust-pickle", "loads; greedy output equals the safetensors model")


# ---- (e) default bind address -----------------------------------------------------------------------


def _host_default() -> str:
    import typer.main

    from quantserve.cli import app

    serve = typer.main.get_command(app).commands["serve"]
    return next(p.default for p in serve.params if p.name == "host")


def _outside_address() -> str | None:
    """This machine's address on its default route, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))  # no packet is sent; only picks the interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_default_bind_is_loopback(trusted):
    assert _host_default() == "127.0.0.1"
    assert f"on http://127.0.0.1:{trusted.port}/v1" in trusted.log()  # started without --host
    outside = _outside_address()
    if outside:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{outside}:{trusted.port}/health", timeout=5)
    FIGURES.add("default bind address", f"127.0.0.1 (outside address {outside or 'none'}: "
                f"{'refused' if outside else 'not tested'})")


# ---- (f) CORS -----------------------------------------------------------------------------------------


def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(base + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_by_default(trusted):
    base = trusted.base_url
    assert "access-control-allow-origin" not in _preflight(base, ORIGIN).headers
    r = httpx.get(base + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.post(base + "/v1/chat/completions", headers={"Origin": ORIGIN}, json=_chat(None)["json"])
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # the preflight-free POST a web page can send (text/plain) is refused outright
    r = httpx.post(base + "/v1/chat/completions", headers={"Origin": EVIL, "Content-Type": "text/plain"},
                   content=httpx.Request("POST", "http://x", json=_chat(None)["json"]).content)
    assert_openai_error(r, 415, "unsupported_media_type")
    FIGURES.add("CORS without --cors-origin", "no Access-Control-Allow-Origin on preflight, GET or POST")


def test_cors_allows_only_the_configured_origin(keyed):
    base = keyed.base_url
    ok = _preflight(base, ORIGIN)  # no key on a preflight: answered before the key check
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = _preflight(base, EVIL)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = httpx.post(base + "/v1/chat/completions", headers={"Origin": ORIGIN, **_auth()}, json=_chat()["json"])
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(base + "/v1/chat/completions", headers={"Origin": ORIGIN}, json=_chat(None)["json"])
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # the page can read why
    r = httpx.get(base + "/v1/models", headers={"Origin": EVIL, **_auth()})
    assert "access-control-allow-origin" not in r.headers
    FIGURES.add("CORS with --cors-origin", f"{ORIGIN} allowed (preflight, 200 and 401); other origins not")


# ---- last: the whole log of the keyed server ---------------------------------------------------------


def test_the_key_never_reaches_the_log(keyed):
    """Runs after every request above; stops the server so that its shutdown is logged too."""
    keyed.proc.send_signal(signal.SIGTERM)
    keyed.proc.wait(30)
    keyed._log.flush()
    log = keyed.log_path.read_text()
    # debug and access logging were really on, and saw the refused requests
    assert " DEBUG " in log and '"POST /v1/chat/completions HTTP/1.1" 401' in log, log[-2000:]
    assert KEY not in log, "the API key appears in the server log"
    for k in WRONG_KEYS:
        assert k not in log, "a rejected key appears in the server log"
    FIGURES.add("server log lines at debug level, searched for the key", len(log.splitlines()))
    FIGURES.add("API key (or a rejected key) found in the log", "no")
