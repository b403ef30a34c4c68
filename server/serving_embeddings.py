"""`/v1/embeddings`: each input's final hidden state, pooled (`--embedding-pooling last|mean`)
and L2-normalized as OpenAI's embeddings are, on every engine.

An embedding is a request like any other for the scheduler (a slot, one forward over the input,
no tokens generated), so it queues and batches with the generation requests and counts in the
same limits.  `dimensions` is honoured only where it asks for the model's own width: a causal
LM's hidden state cannot be shortened without a model trained for it (Matryoshka), so any other
value is a 400 rather than a silently different vector.
"""

from __future__ import annotations

import asyncio
import base64

from quantserve.server.engine import EngineClosedError, EngineRequest, QueueFullError
from quantserve.server.errors import APIError, engine_status
from quantserve.server.protocol import EmbeddingRequest
from quantserve.server.sampling import SamplingParams
from quantserve.server.serving import (ServerState, api_error_of, check_model, check_sequences, tokenized,
                                       until_disconnected)
from quantserve.server.unsupported import refuse_fields


# The most tokens one request's inputs may hold in all, as OpenAI's embeddings API: a request of
# 2,048 inputs of 511 tokens (~1M tokens) held the queue for minutes on a CPU.
MAX_TOKENS = 300_000


async def _inputs(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    if req.input == "" or (isinstance(req.input, list) and "" in req.input):
        # OpenAI's rule too: an empty string has nothing to embed (it would be a lone BOS)
        raise APIError(400, "input holds an empty string", param="input")
    return (await tokenized(state.engine.tokenizer, req.input, "input"))[0]


def _width(state: ServerState) -> int | None:
    return state.engine.info.extra.get("hidden_size")


async def embed(state: ServerState, req: EmbeddingRequest, request) -> dict:
    import numpy as np

    check_model(state, req.model)
    refuse_fields(dict(req.model_extra or {}), {}, set(), "OpenAI's embeddings API")
    engine = state.engine
    width = _width(state)
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"dimensions: this model's embeddings have {width} dimensions and cannot be "
                       "shortened (it was not trained for it)", param="dimensions")
    prompts = await _inputs(state, req)
    context, vocab = engine.info.context_length, engine.tokenizer.vocab_size
    for i, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"input {i} is empty", param="input")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="input")
        if len(ids) > context:
            raise APIError(400, f"input {i} is {len(ids)} tokens; this model's maximum context length is "
                           f"{context} tokens", param="input", code="context_length_exceeded")
        pool = engine.info.kv_pool_tokens
        if pool is not None and len(ids) > pool:
            raise APIError(400, f"input {i} is {len(ids)} tokens; the server's KV cache holds {pool} tokens "
                           "in all", param="input", code="context_length_exceeded")
    check_sequences(len(prompts), "inputs", "input")
    total = sum(map(len, prompts))
    if total > MAX_TOKENS:
        raise APIError(400, f"the inputs hold {total} tokens in all; one request may hold at most {MAX_TOKENS}",
                       param="input")
    pooling = engine.options.embedding_pooling
    try:
        streams = engine.submit([EngineRequest(ids, SamplingParams(max_tokens=0, embed=pooling)) for ids in prompts])
    except (QueueFullError, EngineClosedError) as e:
        status, code = engine_status(e)
        raise APIError(status, f"Server busy: {e}. Retry later." if status == 429 else str(e), code=code,
                       headers={"Retry-After": str(state.retry_after_s)} if status == 429 else None) from e

    async def result(stream) -> list[float]:
        async for event in stream:
            if event.finish_reason == "error":
                raise api_error_of(event.error)
            if event.embedding is not None:
                return event.embedding
        raise APIError(503, "the embedding was cancelled (the server is shutting down)", code="cancelled")

    try:
        vectors = await until_disconnected(request, asyncio.gather(*(result(s) for s in streams)))
    finally:
        for s in streams:
            s.cancel()
    data = []
    for i, v in enumerate(vectors):
        v = np.asarray(v, dtype=np.float32)
        v = v / max(float(np.linalg.norm(v)), 1e-12)
        out = base64.b64encode(v.tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": out})
    tokens = sum(len(p) for p in prompts)
    state.metrics.prompt_tokens.inc(tokens)
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
