"""Prometheus metrics, named after vLLM's (`vllm:` -> `quantserve:`) so dashboards carry over.

Gauges that describe the engine right now (running, waiting, KV-cache use) are read from
`engine.stats()` at scrape time; counters and histograms are fed by the serving layer.  Each server
has its own registry, so two servers in one process (tests) never share numbers.

Request accounting, per API request (not per choice): every generation request that passed
validation counts once in `request_received_total` and, when it is over, once in
`request_outcome_total{outcome}` (success, error, disconnected, rejected), so once the server is idle
received == the sum of the outcomes.  `request_completion_tokens_total{outcome}` sums the
`usage.completion_tokens` those requests had; for "success" it is what the clients were told.
The process collector adds `process_resident_memory_bytes` and friends (Linux).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in [
            ("quantserve:num_requests_running", "Requests in the running batch.", s.running),
            ("quantserve:num_requests_waiting", "Requests waiting in the admission queue.", s.waiting),
            ("quantserve:kv_cache_usage_perc", "Fraction of KV-cache capacity in use (0-1).", s.kv_usage),
            ("quantserve:kv_cache_used_tokens", "Tokens held in the KV cache.", s.kv_used_tokens),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        # the same load signals under the names routers in front of vLLM read (production-stack's
        # router, SGLang's router, KEDA / HPA rules written for vLLM), so they work unchanged here
        for name, doc, value in [
            ("vllm:num_requests_running", "Requests in the running batch (vLLM's name).", s.running),
            ("vllm:num_requests_waiting", "Requests waiting in the admission queue (vLLM's name).", s.waiting),
            ("vllm:gpu_cache_usage_perc", "Fraction of KV-cache capacity in use, 0-1 (vLLM's name).", s.kv_usage),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        if s.kv_blocks_total is not None:  # a paged KV cache (fast engine)
            yield GaugeMetricFamily("quantserve:kv_cache_blocks_used", "KV-cache blocks (16 tokens) held by "
                                    "running sequences.", value=s.kv_blocks_used)
            yield GaugeMetricFamily("quantserve:kv_cache_blocks_total", "KV-cache blocks in the pool.",
                                    value=s.kv_blocks_total)
            for prefix in ("quantserve", "vllm"):
                yield CounterMetricFamily(f"{prefix}:num_preemptions", "Sequences sent back to wait for KV "
                                          "blocks (their context computed again on resuming).", value=s.preemptions)
        yield CounterMetricFamily("quantserve:engine_generated_tokens", "Tokens sampled by the engine, "
                                  "including those of requests cancelled later.", value=s.generated_tokens)
        yield CounterMetricFamily("quantserve:engine_cancelled_requests", "Requests stopped early by "
                                  "disconnect, stop string or shutdown.", value=s.cancelled)
        # rate(decode_rows) / rate(decode_steps) is the mean decode batch: the continuous batching at work
        yield CounterMetricFamily("quantserve:engine_decode_steps", "Batched decode steps run.",
                                  value=s.decode_steps)
        yield CounterMetricFamily("quantserve:engine_decode_rows", "Sequences advanced by decode steps "
                                  "(one token each).", value=s.decode_rows)
        # rate(hits) / rate(queries) is the prefix cache's hit rate, in prompt tokens (vLLM's meaning)
        for prefix in ("quantserve", "vllm"):
            yield CounterMetricFamily(f"{prefix}:prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache.", value=s.prefix_queried_tokens)
            yield CounterMetricFamily(f"{prefix}:prefix_cache_hits", "Prompt tokens found in the prefix "
                                      "cache (not computed again).", value=s.prefix_hit_tokens)


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        ProcessCollector(registry=r)
        self.prompt_tokens = Counter("quantserve:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("quantserve:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("quantserve:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("quantserve:request_rejected", "Requests refused by status code.",
                                ["status"], registry=r)
        self.received = Counter("quantserve:request_received", "Generation requests that passed validation.",
                                registry=r)
        self.outcomes = Counter("quantserve:request_outcome", "Generation requests by how they ended: "
                                "success, error, disconnected (client gone first) or rejected (429/503).",
                                ["outcome"], registry=r)
        self.outcome_tokens = Counter("quantserve:request_completion_tokens", "usage.completion_tokens of "
                                      "ended generation requests, by outcome.", ["outcome"], registry=r)
        for outcome in ("success", "error", "disconnected", "rejected"):  # exported as 0 from the start
            self.outcomes.labels(outcome)
            self.outcome_tokens.labels(outcome)
        self.ttft = Histogram("quantserve:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("quantserve:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("quantserve:e2e_request_latency_seconds", "Request latency.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # the engine's part of the time to first token, in vLLM's two pieces: waiting for a slot,
        # then the prompt's forwards up to the first sampled token (what is left of the time to
        # first token is the HTTP layer: parsing, tokenizing, streaming)
        self.queue_time = Histogram("quantserve:request_queue_time_seconds", "Time a request waited for a "
                                    "slot in the engine.", buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("quantserve:request_prefill_time_seconds", "Time from taking a slot to "
                                      "the first token sampled.", buckets=_LATENCY_BUCKETS, registry=r)

    def record_choice(self, ttft_s: float | None, latency_s: float, tokens: int, finish_reason: str) -> None:
        self.generation_tokens.inc(tokens)
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if tokens > 1:
                self.tpot.observe((latency_s - ttft_s) / (tokens - 1))

    def record_engine_first_token(self, queued_s: float, elapsed_s: float) -> None:
        """A first token's engine timings: `queued_s` waiting for a slot, `elapsed_s` from submission."""
        self.queue_time.observe(queued_s)
        self.prefill_time.observe(max(0.0, elapsed_s - queued_s))

    def record_outcome(self, outcome: str, completion_tokens: int) -> None:
        self.outcomes.labels(outcome).inc()
        self.outcome_tokens.labels(outcome).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
