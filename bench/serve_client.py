"""`bench serve`'s client: one streamed request timed as a client sees it (time to first token, the
arrival of every chunk with text, the usage the server sends), and a concurrency level's requests
sent through one HTTP session, aiohttp (the default: its C parser keeps the client's own time per
event small) or httpx.

    records, seconds = asyncio.run(run_level(base_url, model, prompts, concurrency=8, output_len=128,
                                             chat=False, ignore_eos=True, api_key=None, timeout=600))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from quantserve.settings import UserError


@dataclass
class Record:
    """One request as seen by the client: wall-clock times in seconds from its start."""
    ok: bool = False  # the stream completed (HTTP 200 through [DONE])
    sent: float = 0.0  # when it was sent, in seconds from the start of its concurrency level
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    error: str | None = None


async def _lines_httpx(client, url: str, body: dict):
    """(status, error text or None, the response's lines) over httpx."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            yield resp.status_code, (await resp.aread())[:200], None
            return
        async for line in resp.aiter_lines():
            yield 200, None, line


async def _lines_aiohttp(client, url: str, body: dict):
    """The same over aiohttp: the body's bytes split into lines as they come."""
    async with client.post(url, json=body) as resp:
        if resp.status != 200:
            yield resp.status, (await resp.read())[:200], None
            return
        pending = b""
        async for chunk in resp.content.iter_any():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                yield 200, None, line.decode().rstrip("\r")
        if pending:
            yield 200, None, pending.decode()


RETRIES = 3  # sends again of a request whose kept-alive connection turned out closed (one_request)
STALE_CONNECTION = ("ServerDisconnectedError", "ClientOSError")  # aiohttp's errors for one
_LINES = {"aiohttp": _lines_aiohttp, "httpx": _lines_httpx}  # each client's reader of an answer's lines
CLIENTS = tuple(_LINES)


async def one_request(session, client: str, url: str, body: dict, chat: bool) -> Record:
    t0 = time.perf_counter()
    rec = Record(sent=t0)
    try:
        for attempt in range(1, RETRIES + 2):
            try:
                # closed as soon as the stream is read, so its connection goes back to the pool at once
                async with contextlib.aclosing(_LINES[client](session, url, body)) as lines:
                    done = await _read_stream(rec, lines, chat, t0)
                break
            except Exception as e:
                # a kept-alive connection the server closed just after its last answer (llama.cpp's
                # server does; httpx drops such a connection before using it, aiohttp finds out on
                # the next request, reading or writing): again if nothing came back, after a pause
                # that lets the event loop see the other connections closed with it (32 answers end
                # together)
                if attempt > RETRIES or type(e).__name__ not in STALE_CONNECTION or rec.ttft is not None:
                    raise
                await asyncio.sleep(0.005 * attempt)
        if rec.error:
            return rec
        if not done:  # the server closed the stream early (llama.cpp's does on a too-long prompt)
            rec.error = "the stream ended without [DONE]"
            return rec
        rec.latency = time.perf_counter() - t0
        rec.output_tokens = rec.output_tokens or len(rec.chunk_times)
        rec.ok = True  # a stream that ends at once (EOS first) is a completed, 0-token request
    except Exception as e:  # a failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _read_stream(rec: Record, lines, chat: bool, t0: float) -> bool:
    """Fill `rec` from the answer's lines; True when the stream ended with [DONE] (an error
    reply or an error event sets rec.error)."""
    async for status, error, line in lines:
        if status != 200:
            rec.error = f"HTTP {status}: {error!r}"
            return False
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        obj = json.loads(data)
        if obj.get("error"):  # an error inside a started stream (after the HTTP 200)
            rec.error = f"error event: {json.dumps(obj['error'])[:200]}"
            return False
        if obj.get("usage"):
            rec.prompt_tokens = obj["usage"].get("prompt_tokens")
            rec.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            rec.output_tokens = obj["usage"].get("completion_tokens") or rec.output_tokens
        for ch in obj.get("choices") or []:
            text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            if text:
                now = time.perf_counter() - t0
                if rec.ttft is None:
                    rec.ttft = now
                rec.chunk_times.append(now)
    return False


def _session(client: str, concurrency: int, timeout: float, headers: dict):
    """An HTTP client session of the kind asked for, with a connection for every concurrent request."""
    if client == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
    try:
        import aiohttp
    except ImportError:
        raise UserError("bench serve's default client needs aiohttp (pip install aiohttp), or pass --client httpx") \
            from None
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 4), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=timeout))


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, output_len: int,
                    chat: bool, ignore_eos: bool, api_key: str | None, timeout: float,
                    json_schema: dict | None = None, prefix: str | None = None,
                    client: str = "aiohttp") -> tuple[list[Record], float]:
    url = base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)

    def body(p: str) -> dict:
        b = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
             "stream_options": {"include_usage": True}}
        if chat:
            system = [{"role": "system", "content": prefix}] if prefix else []
            b["messages"] = [*system, {"role": "user", "content": p}]
        else:
            b["prompt"] = f"{prefix}\n\n{p}" if prefix else p
        if ignore_eos:
            b["ignore_eos"] = True  # vLLM / llama.cpp extension: fixed output length
        if json_schema is not None:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json_schema}}
        return b

    async with _session(client, concurrency, timeout, headers) as session:
        async def guarded(p):
            async with sem:
                return await one_request(session, client, url, body(p), chat)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(guarded(p) for p in prompts))
        for r in records:
            r.sent -= t0
        return list(records), time.perf_counter() - t0
