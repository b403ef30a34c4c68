"""ASGI middleware: each request's arrival time, request body size limit, JSON-only request bodies
and the optional Bearer API key.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
detection pass through untouched.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import time

from quantserve.server.errors import error_body

# Paths anyone may read: probes and scrapers usually carry no key.
OPEN_PATHS = ("/health", "/metrics")
# When the request being handled reached the app (time.perf_counter()), set by ArrivalMiddleware in
# the request's own task, where its route runs too
ARRIVAL: contextvars.ContextVar[float] = contextvars.ContextVar("quantserve_arrival")


async def _send_error(send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class ArrivalMiddleware:
    """Notes when each request reached the app, before its body is read: its time to first token
    counts from here, as its client counts it, so parsing, the chat template and tokenizing are in
    it (32 long prompts arriving together spent ~30 ms there on a GPU server, which a timer
    started at the engine's submission left out)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            ARRIVAL.set(time.perf_counter())
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413, whether or not they announce a Content-Length."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"request body exceeds the limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, too_big, "request_too_large")
        # read the body here, counting, then replay it to the app
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, 413, too_big, "request_too_large")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: the real channel, so disconnects are seen

        return await self.app(scope, replay, send)


class JSONBodyMiddleware:
    """POST bodies must say `Content-Type: application/json` (or `*/*+json`); others get 415.

    FastAPI would parse a text/plain or untyped body as JSON anyway.  Refusing them closes a
    cross-site hole: a web page can make a browser send a text/plain (or untyped) POST to a server on
    localhost without a CORS preflight, so without this check any site a user visits could run
    generations on an unauthenticated local server.  A JSON content type forces the preflight,
    which only origins allowed with `--cors-origin` pass.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        value = dict(scope.get("headers") or []).get(b"content-type", b"")
        media = value.split(b";", 1)[0].strip().lower()
        if media != b"application/json" and not (media.startswith(b"application/") and media.endswith(b"+json")):
            return await _send_error(send, 415, "Request bodies must be JSON: send 'Content-Type: application/json'.",
                                     "unsupported_media_type")
        return await self.app(scope, receive, send)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on everything but the open paths; constant-time comparison."""

    def __init__(self, app, api_key: str, open_methods: tuple[str, ...] = ()):
        self.app = app
        self._expected = b"bearer " + api_key.encode()
        self._open_methods = open_methods  # the gateway's OPTIONS: CORS preflights go on to a replica

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope.get("method") in self._open_methods:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        # the scheme's name is case-insensitive (RFC 9110 11.1): "bearer KEY" is as good as "Bearer KEY"
        if not hmac.compare_digest(given[:7].lower() + given[7:], self._expected):
            # never echo or log what was sent
            return await _send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                     "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)
