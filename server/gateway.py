"""The front door of `quantserve serve --replicas`: one address, each request proxied to a replica.

Ray Serve places, health-checks, replaces and scales the replicas, and the registry lists the ones
up (server/replica_server.py).  This gateway, a plain ASGI app under uvicorn in the command's own
process, sends every request unchanged straight to one replica's HTTP port and passes the answer
back as it comes, the way the routers in front of vLLM and SGLang workers do (production-stack's
router, sglang-router): neither a request nor a stream's events pass through Ray.

- Which replica: the one with the fewest requests in flight from here (ties taken in turn).  With
  `--routing session`, the one a session's key (the `x-session-id` header, else the body's `user`)
  ranks first by rendezvous hashing over the replicas up, so a conversation keeps its replica and
  what it has cached; a replica coming or going moves only its own sessions.
- A replica that cannot be reached, or that drops the connection before a whole answer, is passed
  over for a while (until the registry drops it, or DOWN_S); a non-streamed request is then sent
  once more, to another.  A stream is retried the same way until its first bytes went out; a
  stream whose replica dies after that ends with an OpenAI error event.
- A client that leaves closes the connection to the replica, which stops the generation there.
- An answer is streamed through when it is `text/event-stream`, else read whole first (so that a
  replica dying half-way through it can still be retried).
- `/metrics` is the gateway's own: every replica's page, each sample labelled `replica` (one
  replica's page per scrape would have Prometheus read each switch as a counter reset).

The registry is watched from a thread of its own through `watch` (a blocking long poll that
server/replicas.py builds on Ray), so this module never imports Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("quantserve.server")

REPLICA_HEADER = b"x-quantserve-replica"  # which replica answered (tests, debugging)
SESSION_HEADER = b"x-session-id"
DOWN_S = 10.0  # how long a replica that failed a request is passed over
KEEPALIVE_S = 30.0  # idle connections to replicas are closed after this (replicas keep theirs 75 s)
METRICS_TIMEOUT_S = 5.0  # a replica's /metrics page, for the gateway's merged one
PROBE_IDLE_S, PROBE_INTERVAL_S, PROBE_COUNT = 10, 5, 3  # TCP keepalive: a vanished replica fails in ~25 s
# connection-level headers: each hop has its own (RFC 9110 7.6.1); Host and Content-Length are
# set again for the replica's connection
_REQUEST_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                b"upgrade", b"host", b"content-length", b"expect"}
_RESPONSE_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade"}


@dataclass
class Replica:
    id: str
    url: str
    inflight: int = 0  # requests this gateway has at the replica now
    down_until: float = 0.0  # monotonic time until which it is passed over


def _rank(session: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{replica_id}".encode(), digest_size=8).digest(), "big")


class Routes:
    """The replicas up, and the choice of one for a request."""

    def __init__(self, routing: str):
        self.routing = routing
        self.replicas: dict[str, Replica] = {}
        self.seen_any = False  # a replica was up once (before that, /health says the model loads)
        self._turn = 0

    def update(self, members: dict[str, str]) -> None:
        """The registry's list (id -> URL); the replicas kept keep their counts."""
        for rid in [r for r in self.replicas if r not in members]:
            del self.replicas[rid]
        for rid, url in members.items():
            known = self.replicas.get(rid)
            if known is None or known.url != url:
                self.replicas[rid] = Replica(rid, url)
        self.seen_any = self.seen_any or bool(members)

    def pick(self, session: str | None, tried: set[str]) -> Replica | None:
        """Replicas not tried yet and not passed over first, then the others (a replica that
        failed once may have dropped only an old connection, and there may be no other)."""
        if not self.replicas:
            return None
        now = time.monotonic()
        tier = {rid: (rid in tried, r.down_until > now) for rid, r in self.replicas.items()}
        best = min(tier.values())
        pool = [r for r in self.replicas.values() if tier[r.id] == best]
        if session is not None:
            return max(pool, key=lambda r: _rank(session, r.id))
        fewest = min(r.inflight for r in pool)
        pool = [r for r in pool if r.inflight == fewest]
        self._turn += 1
        return pool[self._turn % len(pool)]


class _Failed(Exception):
    """The replica failed before any byte of its answer went to the client: retry elsewhere."""


def _session_key(headers: list, body: bytes) -> str | None:
    for k, v in headers:
        if k == SESSION_HEADER and v:
            return v.decode("latin-1")[:256]
    try:
        payload = json.loads(body) if body else None
    except (ValueError, RecursionError):  # nested past the parser's depth: not a ValueError
        return None  # the replica answers a bad body with its own 400
    user = payload.get("user") if isinstance(payload, dict) else None
    return user[:256] if isinstance(user, str) and user else None


RETRY_AFTER_S = 5  # the gateway's 503s (loading, no replica up): as the server's own while it loads


async def _send_error(send, status: int, message: str, code: str) -> None:
    from quantserve.server.errors import error_body

    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 503:  # clients (the openai SDK) wait this long before their retry
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _left(receive) -> None:
    """Returns when the client has gone (uvicorn also says so once the answer is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _probed_socket(addr_info) -> socket.socket:
    """A connection to a replica with TCP keepalive probes: a node that vanishes (power, network)
    sends no reset, and without them a request waiting on it would wait forever (there is no read
    timeout: a long answer may take minutes).  Idle PROBE_IDLE_S, then PROBE_COUNT probes
    PROBE_INTERVAL_S apart, then the connection fails and the request is retried or ended."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", PROBE_IDLE_S), ("TCP_KEEPINTVL", PROBE_INTERVAL_S),
                          ("TCP_KEEPCNT", PROBE_COUNT)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock


def _sse_error(message: str) -> bytes:
    from quantserve.server.errors import error_body

    return f"data: {json.dumps(error_body(503, message, code='replica_died'))}\n\n".encode()


class Gateway:
    """The ASGI app.  `watch(version) -> (version, {replica id: url})` is the registry's long poll."""

    def __init__(self, routing: str, watch, max_body_bytes: int):
        self.routes = Routes(routing)
        self.watch = watch
        self.max_body_bytes = max_body_bytes
        self.client = None  # an aiohttp.ClientSession, made in the app's start-up (it needs the loop)
        self._stop = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    # ---- start-up and shutdown ---------------------------------------------------------------

    async def _lifespan(self, receive, send) -> None:
        import aiohttp  # ray[serve] brings it: a C-parsed HTTP client with a connection pool

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.client = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, socket_factory=_probed_socket),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5), auto_decompress=False,
                    skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
                loop = asyncio.get_running_loop()
                threading.Thread(target=self._follow_registry, args=(loop,), name="quantserve-registry-watch",
                                 daemon=True).start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self._stop.set()  # the thread ends after its current poll (it is a daemon: nothing waits)
                await self.client.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _follow_registry(self, loop: asyncio.AbstractEventLoop) -> None:
        version = None
        while not self._stop.is_set():
            try:
                version, members = self.watch(version)
            except Exception as e:  # noqa: BLE001 - the registry restarting, or Ray going down
                if self._stop.is_set():
                    return
                log.warning("the replica registry did not answer (%s: %s); asking again", type(e).__name__, e)
                time.sleep(1.0)
                continue
            try:
                loop.call_soon_threadsafe(self.routes.update, members)
            except RuntimeError:  # the loop has closed: the gateway has stopped
                return

    # ---- one request -------------------------------------------------------------------------

    async def _http(self, scope, receive, send) -> None:
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            return await self._metrics(send)
        chunks, size = [], 0
        while True:  # the whole body first: it may be sent twice
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await _send_error(send, 413, f"Request body is larger than {self.max_body_bytes} bytes",
                                         "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        session = _session_key(scope["headers"], body) if self.routes.routing == "session" else None
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        try:  # aiohttp writes header values as UTF-8: read them so, or a non-ASCII byte is sent twice encoded
            headers = [(k.decode("latin-1"), v.decode("utf-8")) for k, v in scope["headers"] if k not in _REQUEST_HOP]
        except UnicodeDecodeError:
            return await _send_error(send, 400, "a request header is not valid UTF-8", "invalid_header")
        relay = asyncio.ensure_future(self._relay(scope["method"], target.decode("latin-1"), headers, body,
                                                  session, send))
        gone = asyncio.ensure_future(_left(receive))
        try:
            await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():  # the client left: closing the replica's connection stops its work
                relay.cancel()
                try:
                    await relay
                except asyncio.CancelledError:
                    pass
        if not relay.cancelled():
            relay.result()

    async def _metrics(self, send) -> None:
        """Every replica's /metrics merged by prometheus_client (families kept whole, as the text
        format wants them), each sample labelled with its replica; a replica that does not answer
        within METRICS_TIMEOUT_S is left out of this scrape."""
        from prometheus_client import generate_latest
        from prometheus_client.exposition import CONTENT_TYPE_LATEST
        from prometheus_client.parser import text_string_to_metric_families

        async def page(replica: Replica) -> tuple[str, str | None]:
            try:
                async with asyncio.timeout(METRICS_TIMEOUT_S):
                    async with self.client.get(replica.url + "/metrics") as response:
                        return replica.id, (await response.text()) if response.status == 200 else None
            except Exception:  # noqa: BLE001 - down or slow: this scrape goes on without it
                return replica.id, None

        pages = [p for p in await asyncio.gather(*(page(r) for r in list(self.routes.replicas.values())))
                 if p[1] is not None]
        if not pages:
            return await _send_error(send, 503, "no replica is up to report metrics; retry later", "no_replica")
        families: dict[str, object] = {}
        for rid, text in pages:
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, type(family)(family.name, family.documentation, family.type))
                merged.samples += [s._replace(labels={**s.labels, "replica": rid}) for s in family.samples]

        class _Pages:  # what generate_latest asks of a registry
            def collect(self):
                return list(families.values())

        body = generate_latest(_Pages())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _relay(self, method: str, target: str, headers: list, body: bytes, session: str | None, send) -> None:
        tried: set[str] = set()
        for attempt in (1, 2):
            replica = self.routes.pick(session, tried)
            if replica is None:
                break
            tried.add(replica.id)
            replica.inflight += 1
            try:
                return await self._forward(replica, method, target, headers, body, send)
            except _Failed as e:
                replica.down_until = time.monotonic() + DOWN_S
                log.warning("replica %s failed a request (attempt %d): %s", replica.id, attempt, e)
            finally:
                replica.inflight -= 1
        if not tried:
            if self.routes.seen_any:
                return await _send_error(send, 503, "no replica is up; retry later", "no_replica")
            return await _send_error(send, 503, "The model is loading; retry shortly.", "model_loading")
        await _send_error(send, 503, "the replica serving this request died, and so did the one it was "
                          "retried on; retry later", "replica_died")

    async def _forward(self, replica: Replica, method: str, target: str, headers: list, body: bytes, send) -> None:
        import aiohttp
        import yarl

        try:
            # encoded=True: the path and query go on as the client sent them (yarl would re-quote %zz
            # and resolve /../ otherwise)
            response = await self.client.request(method, yarl.URL(replica.url + target, encoded=True), headers=headers,
                                                 data=body if body else None, allow_redirects=False)
        except aiohttp.ClientError as e:  # refused, reset, or closed before the answer's head
            raise _Failed(f"{type(e).__name__}: {e}") from None
        async with response:  # gives the connection back, or closes it when the answer was not read to its end
            out = [(k, v) for k, v in response.raw_headers if k.lower() not in _RESPONSE_HOP]
            out.append((REPLICA_HEADER, replica.id.encode()))
            if response.content_type != "text/event-stream":
                try:
                    content = await response.read()
                except aiohttp.ClientError as e:
                    raise _Failed(f"{type(e).__name__} while reading the answer: {e}") from None
                await send({"type": "http.response.start", "status": response.status, "headers": out})
                await send({"type": "http.response.body", "body": content})
                return
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            last = b"\n\n"
            try:
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    last = chunk[-2:] if len(chunk) >= 2 else last[-1:] + chunk
            except aiohttp.ClientError as e:
                replica.down_until = time.monotonic() + DOWN_S
                log.warning("replica %s died under a stream: %s", replica.id, type(e).__name__)
                # an event cut midway ends first, so the error is an event of its own
                cut = b"" if last == b"\n\n" else b"\n\n"
                await send({"type": "http.response.body", "more_body": True,
                            "body": cut + _sse_error("the replica serving this stream died; the reply is incomplete")})
            await send({"type": "http.response.body", "body": b""})
