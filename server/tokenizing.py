"""Prompts tokenized off the event loop.

Tokenizing a ~1,500-token prompt took ~2 ms on the event loop (py-spy of the fast engine's server
under load, an H200 host): 32 clients arriving together (a chat service's system prompt, the
shared-prefix load) queued ~64 ms of it in front of their first tokens, and every running stream's
next event waited behind it too.  A fast (Rust) tokenizer releases the GIL while it encodes, so
here long prompts are encoded on a few worker threads at once while the loop goes on; shorter ones
stay on the loop, where they cost less than the hand-off.  vLLM's API server moves tokenization
off its loop the same way.

Where the line lies (bench/loop_probe.py, bursts of 32 prompts, on a 2-core Xeon): prompts of
32,000 characters took 0.74x the time off the loop and the loop's p99 latency fell from 254 to 86
ms; 16,000 characters, 0.88x and 118 -> 61 ms; 6,400 characters were 1.15x slower off it.  A host
with more cores than this one moves the line down.

Only tokenizers that say `thread_safe = True` go to the threads (server/hf_engine.py's, which
only reads the Rust tokenizer); llama.cpp's tokenizer in the gguf engine stays on the loop.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

OFF_LOOP_CHARS = 8192  # a request's texts shorter than this together stay on the loop (see above)
WORKERS = 4

_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="quantserve-tokenize")
    return _pool


async def encode_all(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's token ids; when the texts are long together, encoded on worker threads (in parallel)."""
    if not getattr(tokenizer, "thread_safe", False) or sum(len(t) for t in texts) < OFF_LOOP_CHARS:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    loop = asyncio.get_running_loop()
    encode = functools.partial(tokenizer.encode, add_special_tokens=add_special_tokens)
    return list(await asyncio.gather(*(loop.run_in_executor(_threads(), encode, t) for t in texts)))


__all__ = ["OFF_LOOP_CHARS", "encode_all"]
