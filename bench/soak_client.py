"""The soak's clients: random requests, each read to the end and checked, or walked away from.

A request is /v1/completions or /v1/chat/completions, streamed or not, with one of three fates
(complete, abort mid-stream, abort early); bench/soak.py runs many of these loops against a server
and checks its /metrics against what they counted here.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

ABORT_TOKENS = 48  # long enough that an aborted stream is still running when the client leaves
PROMPTS = ["What is 12 + 30?", "Repeat: k q m", "Sort: d a c b", "What comes after g?",
           "How many letters in: a b c d e", "What is the capital of Keltria?",
           "Count from 1 to 9.", "Reverse: q w e r t y"]


@dataclass
class ClientCounts:
    """What the clients saw during the measured phase."""

    sent: int = 0
    completed: int = 0
    completion_tokens: int = 0  # usage.completion_tokens of completed requests
    rejected_429: int = 0
    aborted_mid_stream: int = 0
    aborted_after_headers: int = 0
    aborted_no_reply: int = 0  # non-streaming: gave up before any reply
    by_kind: dict = field(default_factory=dict)  # "chat/stream" -> completed count
    unexpected: int = 0
    unexpected_samples: list = field(default_factory=list)  # the first few, for the report

    @property
    def aborted(self) -> int:
        return self.aborted_mid_stream + self.aborted_after_headers + self.aborted_no_reply

    def error(self, what: str) -> None:
        self.unexpected += 1
        if len(self.unexpected_samples) < 10:
            self.unexpected_samples.append(what[:300])


# ---- one request ----------------------------------------------------------------------------------

def _plan(rng: random.Random, model: str, abort_fraction: float) -> dict:
    """A random request: endpoint, streaming, fate and body."""
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    fate = "complete"
    if rng.random() < abort_fraction:
        fate = rng.choice(["mid_stream", "after_headers"]) if stream else "no_reply"
    prompt = rng.choice(PROMPTS)
    body = {"model": model, "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1 << 30)}
    if fate == "complete":
        body["max_tokens"] = rng.randint(1, 32)
        body["n"] = 2 if rng.random() < 0.1 else 1
        if rng.random() < 0.3:  # run to max_tokens: longer sequences, fuller batches
            body["ignore_eos"] = True
    else:
        body.update(max_tokens=ABORT_TOKENS, ignore_eos=True, n=1)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "chat": chat, "stream": stream,
            "fate": fate, "body": body, "kind": f"{'chat' if chat else 'completions'}/"
            f"{'stream' if stream else 'plain'}"}


def _check_usage(usage, n: int, max_tokens: int, finishes: list, ignore_eos: bool) -> str | None:
    if usage is None:
        return "no usage"
    if usage.total_tokens != usage.prompt_tokens + usage.completion_tokens:
        return f"usage does not add up: {usage}"
    if not n <= usage.completion_tokens <= n * max_tokens:
        return f"{usage.completion_tokens} completion tokens for n={n}, max_tokens={max_tokens}"
    if n == 1 and finishes[0] == "length" and usage.completion_tokens != max_tokens:
        return f"finish_reason length after {usage.completion_tokens} of {max_tokens} tokens"
    if ignore_eos and (set(finishes) != {"length"} or usage.completion_tokens != n * max_tokens):
        return f"ignore_eos, yet {finishes} after {usage.completion_tokens} of {n} x {max_tokens} tokens"
    return None


def _check_reply(plan: dict, data: dict) -> tuple[str | None, int]:
    """(problem or None, completion tokens) for a non-streaming 200 body."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = plan["body"]
    reply = (ChatCompletion if plan["chat"] else Completion).model_validate(data)
    texts = [c.message.content if plan["chat"] else c.text for c in reply.choices]
    finishes = [c.finish_reason for c in reply.choices]
    if sorted(c.index for c in reply.choices) != list(range(body["n"])):
        return f"choice indices {[c.index for c in reply.choices]} for n={body['n']}", 0
    if any(f not in ("stop", "length") for f in finishes) or any(not isinstance(t, str) for t in texts):
        return f"bad choices: {finishes} {texts}", 0
    problem = _check_usage(reply.usage, body["n"], body["max_tokens"], finishes,
                           body.get("ignore_eos", False))
    return problem, reply.usage.completion_tokens if reply.usage else 0


class _StreamCheck:
    """Accumulates a stream's events; `result()` says whether it was a complete, valid reply."""

    def __init__(self, plan: dict):
        self.plan, self.events, self.done = plan, 0, False
        self.finishes: dict[int, str] = {}
        self.usage = None
        self.problem: str | None = None

    def feed(self, line: str) -> None:
        from openai.types import Completion
        from openai.types.chat import ChatCompletionChunk

        if not line.startswith("data: ") or self.problem:
            return
        payload = line[6:]
        if payload == "[DONE]":
            self.done = True
            return
        self.events += 1
        data = json.loads(payload)
        if "error" in data:
            self.problem = f"error event: {data['error']}"
            return
        if self.plan["chat"]:
            chunk = ChatCompletionChunk.model_validate(data)
        else:  # the SDK has no completions chunk type: its Completion wants a finish_reason, which a
            # streamed chunk (OpenAI's own too) leaves null until the choice ends
            chunk = Completion.model_validate({**data, "choices": [
                {**c, "finish_reason": c.get("finish_reason") or "length"} for c in data.get("choices", [])]})
            for c in data.get("choices", []):
                if c.get("finish_reason"):
                    self.finishes[c["index"]] = c["finish_reason"]
            self.usage = chunk.usage or self.usage
            return
        self.usage = chunk.usage or self.usage
        for c in chunk.choices:
            if c.finish_reason:
                self.finishes[c.index] = c.finish_reason

    def result(self) -> tuple[str | None, int]:
        body = self.plan["body"]
        if self.problem:
            return self.problem, 0
        if not self.done:
            return "stream ended without [DONE]", 0
        finishes = [self.finishes.get(i) for i in range(body["n"])]
        if any(f not in ("stop", "length") for f in finishes):
            return f"stream finish reasons {finishes}", 0
        problem = _check_usage(self.usage, body["n"], body["max_tokens"], finishes,
                               body.get("ignore_eos", False))
        return problem, self.usage.completion_tokens if self.usage else 0


async def _rejected(resp, counts: ClientCounts) -> float | None:
    """Seconds to wait for a well-formed 429; None (and an unexpected error) for anything else."""
    data = json.loads(await resp.aread())
    retry = resp.headers.get("retry-after")
    if data.get("error", {}).get("code") != "queue_full" or not (retry or "").isdigit():
        counts.error(f"malformed 429: {data} retry-after={retry}")
        return None
    counts.rejected_429 += 1
    return float(retry)


async def one_request(client, url: str, plan: dict, counts: ClientCounts, rng: random.Random) -> float:
    """Send one planned request, update `counts`; returns seconds to back off (after a 429)."""
    counts.sent += 1
    headers = {"Accept": "text/event-stream"} if plan["stream"] else {}
    if plan["stream"]:
        async with client.stream("POST", url + plan["path"], json=plan["body"], headers=headers) as resp:
            if resp.status_code == 429:
                return await _rejected(resp, counts) or 0.0
            if resp.status_code != 200:
                counts.error(f"{plan['kind']}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return 0.0
            if plan["fate"] == "after_headers":
                counts.aborted_after_headers += 1
                return 0.0  # leaving the block closes the connection
            check, stop_after = _StreamCheck(plan), rng.randint(1, 4)
            async for line in resp.aiter_lines():
                check.feed(line)
                if plan["fate"] == "mid_stream" and check.events >= stop_after and not check.done:
                    counts.aborted_mid_stream += 1
                    return 0.0
        problem, tokens = check.result()
    else:
        post = client.post(url + plan["path"], json=plan["body"])
        if plan["fate"] == "no_reply":
            try:
                resp = await asyncio.wait_for(post, timeout=rng.uniform(0.02, 0.5))
            except asyncio.TimeoutError:  # cancelling the request closes its connection
                counts.aborted_no_reply += 1
                return 0.0
        else:
            resp = await post
        if resp.status_code == 429:
            return await _rejected(resp, counts) or 0.0
        if resp.status_code != 200:
            counts.error(f"{plan['kind']}: HTTP {resp.status_code}: {resp.text[:200]}")
            return 0.0
        problem, tokens = _check_reply(plan, resp.json())
    if problem:
        counts.error(f"{plan['kind']}: {problem}")
        return 0.0
    counts.completed += 1
    counts.completion_tokens += tokens
    counts.by_kind[plan["kind"]] = counts.by_kind.get(plan["kind"], 0) + 1
    return 0.0


async def client_loop(client, url: str, model: str, abort_fraction: float, until: float, seed: int,
                      counts: ClientCounts) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < until:
        plan = _plan(rng, model, abort_fraction)
        try:
            backoff = await one_request(client, url, plan, counts, rng)
        except Exception as e:  # a timeout, a reset connection, a body that is not JSON ...
            counts.error(f"{plan['kind']}: {type(e).__name__}: {e}")
            backoff = 0.0
        if backoff:
            await asyncio.sleep(min(backoff, max(0.0, until - time.perf_counter())))


async def run_load(client, url: str, model: str, clients: int, abort_fraction: float, seconds: float,
                   seed: int) -> ClientCounts:
    """`clients` concurrent loops of random requests for `seconds`; what they saw, added up."""
    counts = ClientCounts()
    until = time.perf_counter() + seconds
    await asyncio.gather(*(client_loop(client, url, model, abort_fraction, until, seed * 1000 + i, counts)
                           for i in range(clients)))
    return counts
