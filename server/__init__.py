"""quantserve's OpenAI-compatible server.

Routes -> serving logic -> engine -> scheduler -> decode backend:

    api_server.py          the routes (one APIRouter), error handlers, model loading at start-up
    middleware.py          body size limit, Bearer API key (constant-time compare)
    protocol.py            pydantic request / response models (the OpenAI wire format)
    serving.py             validation, context check, submit / cancel, merging choice streams
    serving_completions.py /v1/completions;  serving_chat.py /v1/chat/completions (and _embeddings, _responses)
    textstream.py          incremental detokenization, stop strings, logprob entries
    metrics.py             Prometheus metrics
    engine.py              the Engine interface the API layer sees (submit, TokenStream, cancel, stats)
    engines.py             picks hf / fast / gguf by path and option; ScheduledEngine
    scheduler.py           continuous batching thread shared by every engine
    sampling.py            per-request sampling, seeds, penalties, logprobs
    backend.py             DecodeBackend (the decode seam) and HFBackend (transformers)
    hf_engine.py           transformers / bitsandbytes loading
    gguf_engine.py         llama.cpp backend (multi-sequence batches) and GGUF tokenizer
    fastcore/              static-KV-cache decode core behind the same seam (loader.py: its loading)
"""
