"""`quantserve serve MODEL --replicas N|auto`: copies of the server behind Ray Serve.

Two deployments in one Ray Serve application:

- `ModelReplica`: the server itself, `create_app` over its own engine, one GPU each where there
  are GPUs.  Ray Serve runs the app's start-up, which here waits for the model: a replica is
  ready only once it can answer.  Its health check fails when the engine's scheduler thread has
  died, and Ray Serve replaces it.
- `Gateway`: the HTTP entry (Ray Serve's proxy routes every path to it).  It forwards each request
  whole to a replica through a deployment handle and passes the answer back, streams included.
  A non-streamed request whose replica dies is sent once more, to another; a stream whose replica
  dies after it began ends with an OpenAI error event.  With `--routing session` the handle
  carries a session id (the `x-session-id` header, else the body's `user`), which Ray Serve's
  consistent-hash router maps to one replica, so a conversation keeps its replica (and what that
  replica has cached); otherwise Ray Serve's default router picks the less loaded of two replicas.

Autoscaling (`--replicas auto`) is Ray Serve's own, on ongoing requests per replica: the target is
the replica's `--max-batch`, so requests that would wait in a replica's queue add replicas.
Everything Ray-specific stays in this module; without `--replicas` Ray is never imported.
"""


import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from quantserve.server.config import EngineOptions

log = logging.getLogger("quantserve.server")

ROUTINGS = ("least-loaded", "session")
REPLICA_HEADER = "x-quantserve-replica"  # which replica answered (tests, debugging)
SESSION_HEADER = "x-session-id"
# what the gateway does not copy from a replica's answer: the framework sets them again
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server"}


@dataclass
class ReplicaOptions:
    replicas: int | None  # None: autoscaled between 1 and max_replicas
    max_replicas: int = 4
    routing: str = "least-loaded"
    address: str | None = None  # an existing Ray cluster; None starts a local one
    host: str = "127.0.0.1"
    port: int = 8000
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    gpus_per_replica: float | None = None  # None: 1 where the node has GPUs, else 0
    stream_interval_ms: float = 10.0  # a stream's chunks leave a replica at most this often
    cpus_per_replica: float = 1.0


def parse_replicas(text: str) -> int | None:
    """`--replicas`: a count >= 1, or 'auto' (None)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--replicas must be a number of replicas or 'auto', not {text!r}") from None
    if n < 1:
        raise ValueError(f"--replicas must be at least 1 (got {n})")
    return n


def _json_object(body: bytes) -> dict:
    """The body as a JSON object, or {} (the replica answers a bad body with its own 400)."""
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _session_of(headers, payload: dict) -> str | None:
    session = headers.get(SESSION_HEADER)
    if session:
        return session[:256]
    user = payload.get("user")
    return user[:256] if isinstance(user, str) and user else None


def _sse_error(message: str) -> bytes:
    from quantserve.server.errors import error_body

    return f"data: {json.dumps(error_body(503, message, code='replica_died'))}\n\n".encode()


def _copy(headers) -> dict:
    out: dict[str, str] = {}
    for k, v in headers:
        if k.lower() not in _HOP_HEADERS:
            out[k.decode("latin-1")] = v.decode("latin-1")
    return out


async def _rest(chunks, died):
    """The rest of a replica's stream; an OpenAI error event if the replica dies mid-way."""
    try:
        async for chunk in chunks:
            yield chunk
    except died:
        yield _sse_error("the replica serving this stream died; the reply is incomplete")


async def coalesce(items, interval_s: float):
    """Re-yield `items` (a `ResponseStart`, then bytes), joining the bytes that arrive within
    `interval_s` of the last yield; the first chunk and the end are never held back."""
    import asyncio

    from quantserve.server.asgi_call import ResponseStart

    if interval_s <= 0:
        async for item in items:
            yield item
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump():
        try:
            async for item in items:
                await queue.put(item)
            await queue.put(end)
        except BaseException as e:  # re-raised on the yielding side
            await queue.put(e)
            raise

    task = asyncio.ensure_future(pump())
    try:
        last = -1e9
        while True:
            item = await queue.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, ResponseStart):
                yield item
                continue
            parts, done = [item], False
            wait = interval_s - (loop.time() - last)
            if wait > 0:
                await asyncio.sleep(wait)
            while not queue.empty():
                more = queue.get_nowait()
                if more is end or isinstance(more, BaseException):
                    queue.put_nowait(more)  # handled on the next turn, after this chunk is out
                    break
                parts.append(more)
            yield b"".join(parts)
            last = loop.time()
    finally:  # also when the client left: the pump's cancellation closes `items`, and so the app's request
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - its end is all that is wanted here
            pass


def build_application(model: str, engine_options: EngineOptions, name: str, app_kwargs: dict,
                      opts: ReplicaOptions):
    """The Ray Serve application: the gateway bound to the model replicas."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from ray import serve
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from quantserve.server.asgi_call import ResponseStart, call_asgi

    replica_died = (RayActorError, ActorDiedError, ActorUnavailableError)

    class ModelReplica:
        async def __init__(self):
            from quantserve.server.api_server import create_app
            from quantserve.server.engines import ScheduledEngine

            self.engine = ScheduledEngine(Path(model), engine_options)
            self.app = create_app(self.engine, name, wait_for_load=True, **app_kwargs)
            self.replica_id = serve.get_replica_context().replica_id.unique_id
            # the app's start-up (the model loads) as uvicorn would run it: Ray Serve routes to the
            # replica once this constructor returns, so it is ready only when it can answer
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()

        async def __del__(self):  # Ray Serve's shutdown of the replica: in-flight requests finish first
            await self._lifespan.__aexit__(None, None, None)

        def check_health(self) -> None:
            if not self.engine.alive():
                raise RuntimeError("the engine's scheduler thread has stopped")

        def _tag(self, start: ResponseStart) -> ResponseStart:
            return ResponseStart(start.status, [*start.headers, (REPLICA_HEADER.encode(), self.replica_id.encode())])

        async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes):
            """A whole request in, a whole response out: (status, headers, body)."""
            start, chunks = None, []
            async for item in call_asgi(self.app, method, path, query, headers, body):
                if isinstance(item, ResponseStart):
                    start = self._tag(item)
                else:
                    chunks.append(item)
            return start.status, start.headers, b"".join(chunks)

        async def forward_stream(self, method: str, path: str, query: bytes, headers: list, body: bytes):
            """The response's start, then its chunks: the first at once, later ones gathered for
            up to `stream_interval_ms` (each item Ray carries costs the replica's process time
            next to the engine; a token's event is ~100 bytes)."""
            chunks = call_asgi(self.app, method, path, query, headers, body)
            async for item in coalesce(chunks, opts.stream_interval_ms / 1000):
                yield self._tag(item) if isinstance(item, ResponseStart) else item

    gateway_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @serve.ingress(gateway_app)
    class Gateway:
        def __init__(self, replicas):
            self.replicas = replicas

        @gateway_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH"])
        async def route(self, request: Request, path: str):
            from quantserve.server.errors import error_response

            body = await request.body()
            limit = app_kwargs.get("max_body_bytes", 4 << 20)
            if len(body) > limit:
                return error_response(413, f"Request body is larger than {limit} bytes", code="request_too_large")
            payload = _json_object(body) if request.method == "POST" else {}  # read once, here only
            handle = self.replicas
            if opts.routing == "session":
                session = _session_of(request.headers, payload)
                if session:
                    handle = handle.options(session_id=session)
            args = (request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body)
            streamed = payload.get("stream") is True
            for attempt in (1, 2):
                try:
                    if not streamed:
                        status, headers, content = await handle.forward.remote(*args)
                        return Response(content, status, headers=_copy(headers))
                    chunks = handle.options(stream=True).forward_stream.remote(*args)
                    start = await chunks.__anext__()  # nothing sent yet: a dead replica can still be retried
                    return StreamingResponse(_rest(chunks, replica_died), start.status, headers=_copy(start.headers))
                except replica_died as e:
                    log.warning("replica died under a request (attempt %d): %s", attempt, type(e).__name__)
            return error_response(503, "the replica serving this request died, and so did the one it was "
                                  "retried on; retry later", code="replica_died")

    gpus = opts.gpus_per_replica
    if gpus is None:
        import ray

        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    replica_config = {
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": opts.cpus_per_replica},
        # the replica's own batch and queue; beyond that, requests wait in Ray Serve's router
        "max_ongoing_requests": engine_options.max_batch + engine_options.max_queue,
        "health_check_period_s": 5, "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": app_kwargs.get("shutdown_grace_s", 10.0) + 5,
    }
    if opts.replicas is None:
        replica_config["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": opts.max_replicas,
            "target_ongoing_requests": engine_options.max_batch,
            "upscale_delay_s": opts.upscale_delay_s, "downscale_delay_s": opts.downscale_delay_s,
            "metrics_interval_s": 1.0, "look_back_period_s": 5.0}
    else:
        replica_config["num_replicas"] = opts.replicas
    if opts.routing == "session":
        from ray.serve.config import RequestRouterConfig

        replica_config["request_router_config"] = RequestRouterConfig(
            request_router_class="ray.serve.experimental.consistent_hash_router.ConsistentHashRouter")
    replicas = serve.deployment(ModelReplica, name="model").options(**replica_config)
    gateway = serve.deployment(Gateway, name="gateway", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000)
    return gateway.bind(replicas.bind())


def start_ray(opts: ReplicaOptions) -> None:
    import ray

    if opts.address:
        ray.init(address=opts.address, logging_level=logging.WARNING, log_to_driver=False)
        return
    # A local cluster on this machine only: its ports (GCS, raylet, object store) bound to loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keeps 127.0.0.1 as the node address
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, configure_logging=True)


def serve_replicas(model: str, engine_options: EngineOptions, name: str, app_kwargs: dict,
                   opts: ReplicaOptions) -> None:
    """Run the replicas until SIGINT or SIGTERM; the ready line is printed once one answers."""
    import ray
    from ray import serve

    start_ray(opts)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": opts.host, "port": opts.port}, logging_config={"log_level": "WARNING"})
        app = build_application(model, engine_options, name, app_kwargs, opts)
        serve.run(app, name="quantserve", route_prefix="/", blocking=False)  # returns once replicas are ready
        count = opts.replicas or f"1 (autoscaled up to {opts.max_replicas})"
        print(f"serving {name} with {count} replica(s) on http://{opts.host}:{opts.port}/v1 "
              f"(Ray Serve, routing {opts.routing})", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
