"""Prompts tokenized off the event loop.

Tokenizing a ~1,500-token prompt took ~2 ms on the event loop (py-spy of the fast engine's server
under load, an H200 host): 32 clients arriving together (a chat service's system prompt, the
shared-prefix load) queued ~64 ms of it in front of their first tokens, and every running stream's
next event waited behind it too.  A fast (Rust) tokenizer releases the GIL while it encodes, so
here long prompts are encoded on a few worker threads at once while the loop goes on; short ones
stay on the loop, where they cost less than the hand-off.  vLLM's API server moves tokenization
off its loop the same way.

Only tokenizers that say `thread_safe = True` go to the threads (server/hf_engine.py's, which
only reads the Rust tokenizer); llama.cpp's tokenizer in the gguf engine stays on the loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

OFF_LOOP_CHARS = 2048  # texts shorter than this (~0.2 ms to encode) stay on the loop
WORKERS = 4

_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="quantserve-tokenize")
    return _pool


async def encode_all(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Each text's token ids, the long ones encoded on worker threads (in parallel)."""
    if not getattr(tokenizer, "thread_safe", False) or sum(len(t) for t in texts) < OFF_LOOP_CHARS:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    loop = asyncio.get_running_loop()
    return list(await asyncio.gather(*(loop.run_in_executor(_threads(), _encode, tokenizer, t, add_special_tokens)
                                       for t in texts)))


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


__all__ = ["OFF_LOOP_CHARS", "encode_all"]
