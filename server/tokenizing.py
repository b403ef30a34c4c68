"""Prompts tokenized off the event loop, the prompts of requests arriving together in one batch.

Tokenizing a ~1,400-token prompt takes ~0.6 ms on this project's CI CPU.  Requests arrive in
bursts (a chat service's clients, the shared-prefix load's 32 clients whose replies end in the
same step), and on the event loop their prompts were
encoded one after another, each in front of the next request's first token and of every running
stream's next event.  So the prompts the loop's requests reach in one turn of the loop are
gathered and encoded together by one call of the Rust tokenizer's batch encoder on a worker
thread: it releases the GIL and spreads the texts over the cores, and the loop goes on meanwhile.
vLLM's API server batches its requests' tokenization the same way (its `AsyncMicrobatchTokenizer`).

Short texts stay on the loop, where encoding costs less than the hand-off: below OFF_LOOP_CHARS
characters a request ($QUANTSERVE_OFF_LOOP_CHARS sets it).  A batch is ready when its slowest
text is, and its texts are encoded side by side only where there are cores to spare, so the line
depends on the cores this process may use.  Where it lies was measured (bench/loop_probe.py,
bursts of 32 prompts), first with a thread per prompt: on a 2-core Xeon, 32,000-character prompts
took 0.74x the time off the loop and 6,400-character ones 1.15x longer; on 8 cores of the GPU
host, 6,400-character prompts took 0.64x and 2,400-character ones 1.23x longer.  Batched, on those
8 cores, 2,400-character prompts took 0.59x the time off the loop (66.7 against 113.8 ms a burst),
and the 1B shape's concurrency-32 throughput rose 1.24x; on the 2-core Xeon the shared-prefix
load's 32 clients waited longer for their first tokens with every prompt off the loop (median
38-42 ms against 22 ms, bench/http_probe.py).  Hence 1,024 characters with 8 cores or more, and
8,192 below.

Only tokenizers that say `thread_safe = True` and have `encode_batch` leave the loop
(server/hf_engine.py's, which only reads the Rust tokenizer); llama.cpp's tokenizer in the gguf
engine stays on the loop.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from quantserve.settings import UserError


def _off_loop_chars() -> int:
    """A request's texts shorter than this together stay on the loop (see above)."""
    value = os.environ.get("QUANTSERVE_OFF_LOOP_CHARS", "").strip()
    if value:
        if not (value.isascii() and value.isdigit()):
            raise UserError(f"QUANTSERVE_OFF_LOOP_CHARS={value!r}: a number of characters (0: every text off the loop)")
        return int(value)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1024 if cores >= 8 else 8192


OFF_LOOP_CHARS = _off_loop_chars()
WORKERS = 2  # batches in flight at once; each one's encoding spreads over the cores by itself

_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="quantserve-tokenize")
    return _pool


class _Batch:
    """The texts one tokenizer is asked for during one turn of the event loop, with their futures."""

    def __init__(self, tokenizer, add_special_tokens: bool):
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens
        self.texts: list[str] = []
        self.futures: list[asyncio.Future] = []

    def encode(self) -> list:  # on a worker thread: each text's ids, or the exception it raised
        try:
            return self.tokenizer.encode_batch(self.texts, self.add_special_tokens)
        except Exception:  # one bad text fails its own request only: each again, alone
            return [_result_or_error(self.tokenizer, t, self.add_special_tokens) for t in self.texts]


def _result_or_error(tokenizer, text: str, add_special_tokens: bool):
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # noqa: BLE001 - handed to the request that sent this text
        return e


# each event loop's batches of this turn, by (tokenizer, add_special_tokens): a batch's futures
# belong to the loop that made them, and only that loop settles them
_gathering: dict[asyncio.AbstractEventLoop, dict[tuple[int, bool], _Batch]] = {}


def _dispatch(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's turn is over: every batch it gathered goes to the worker threads."""
    for batch in _gathering.pop(loop, {}).values():
        loop.run_in_executor(_threads(), batch.encode).add_done_callback(
            lambda done, batch=batch: _settle(batch, done))


def _settle(batch: _Batch, done: asyncio.Future) -> None:
    error = done.exception()
    results = [error] * len(batch.futures) if error is not None else done.result()
    for future, result in zip(batch.futures, results):
        if future.done():  # the request was cancelled meanwhile (its client left)
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


async def encode_all(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's token ids; when the texts are long together, encoded off the loop, in one batch
    with the other requests' texts of this turn of the loop."""
    if not (getattr(tokenizer, "thread_safe", False) and hasattr(tokenizer, "encode_batch")) \
            or sum(len(t) for t in texts) < OFF_LOOP_CHARS:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    loop = asyncio.get_running_loop()
    if loop not in _gathering:
        _gathering[loop] = {}
        loop.call_soon(_dispatch, loop)  # after the callbacks ready now: the other requests of this turn
    batch = _gathering[loop].setdefault((id(tokenizer), add_special_tokens), _Batch(tokenizer, add_special_tokens))
    futures = [loop.create_future() for _ in texts]
    batch.texts += texts
    batch.futures += futures
    return list(await asyncio.gather(*futures))


__all__ = ["OFF_LOOP_CHARS", "encode_all"]
