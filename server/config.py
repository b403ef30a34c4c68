"""`EngineOptions`: every setting of a served engine, and `APIOptions`: the HTTP layer's limits;
the one home of their defaults.

`quantserve serve`'s options take their defaults from here (server/cli.py), and the engines read
nothing else.  Only the standard library is imported, so `--help` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOptions:
    context: int | None = None  # default: the model's trained context
    max_batch: int = 32
    max_queue: int = 64
    gpu_profile: str | None = None
    engine: str = "auto"  # auto (by the path), hf, fast (server/fastcore) or gguf
    weight_quant: str = "none"  # fast engine only: none, int8 or int4 weight-only
    threads: int | None = None  # CPU threads for the model; default: torch's own / half the cores for llama.cpp
    trust_pickle: bool = False  # serve a checkpoint whose weights are only pickles (rewritten as safetensors)
    prefill_chunk: int | None = None  # hf / gguf: prompt tokens per iteration (chunked prefill); None: 512
    max_num_batched_tokens: int | None = None  # fast: tokens per forward, decodes and prompt chunks; None: 2048
    kv_blocks: int | None = None  # fast: the KV pool in blocks of 16 tokens; None: what memory holds
    prefix_cache: bool = True  # reuse the K/V of prompt prefixes computed before (server/prefix_cache.py)
    embedding_pooling: str = "last"  # /v1/embeddings: the last token's final hidden state, or the mean
    kv_cache_dtype: str = "auto"  # fast / gguf engines: auto (16-bit) or int8 (~twice the tokens per GiB)
    async_scheduling: bool = True  # fast: greedy decode steps launched one ahead of the host (paged_scheduler.py)

    def chunk(self) -> int:
        """The row engines' prompt tokens per iteration."""
        return self.prefill_chunk or 512

    def batched_tokens(self) -> int:
        """The fast engine's tokens per forward."""
        return self.max_num_batched_tokens or 2048


@dataclass
class APIOptions:
    max_body_bytes: int = 4 << 20  # largest request body accepted (413 above)
    max_logprobs: int = 20  # most top logprobs one request may ask for
    shutdown_grace_s: float = 10.0  # seconds in-flight requests get to finish on shutdown
