"""Call an ASGI app in-process with one HTTP request, and read its response as it is sent.

A replica behind Ray Serve (server/replicas.py) answers the gateway's forwarded requests with its
own FastAPI app, the same `create_app` a single server runs, so every route, error and middleware
behaves exactly as there.  httpx's ASGI transport would do, but it collects a whole response
before returning one, which would turn a stream into a wait; this yields the response's start,
then each body chunk as the app sends it.  Closing the generator early is the client leaving:
the app sees `http.disconnect`, as from uvicorn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[ResponseStart | bytes]:
    """Yield one `ResponseStart`, then the body's chunks (bytes) until the response ends."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)  # the app returned (or raised): nothing more will come

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": query, "headers": headers, "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 80)}
    task = asyncio.ensure_future(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()  # an app that raised raises here
                raise RuntimeError("the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 10)
            except (asyncio.TimeoutError, Exception):
                task.cancel()
