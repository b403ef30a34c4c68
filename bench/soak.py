"""Soak test for the quantserve server: many clients for a long time, and nothing lost.

    python -m bench.soak --url http://127.0.0.1:8000 --clients 64 --duration 120 [--out soak.json]

Each client loops over random requests: /v1/completions or /v1/chat/completions, streaming or
not, and one of three fates:

- complete: read the whole reply and check it (the `openai` package's own response types, every
  choice finished with "stop" or "length", usage adding up);
- abort mid-stream: close the connection after a few events;
- abort early: close a stream right after its headers, or give up on a non-streaming reply after
  a short random wait.

A 429 (queue full) with Retry-After is an accepted answer: it is counted and the client waits as
told.  Anything else (another status, an error event, a malformed body, a timeout) is an
unexpected error.

Aborted requests ask for exactly ABORT_TOKENS tokens with `ignore_eos`, so when the server
finished one before it noticed the client had gone, its token count is still known; that keeps
the token accounting exact.  After a warm-up phase of the same load the tool records a baseline,
runs the measured phase, waits for the server to go idle and checks its /metrics:

- running = waiting = KV-cache tokens = 0 (no leaked slot or cache);
- request_received == success + error + disconnected + rejected, and error == 0;
- the outcome counts agree with what the clients saw (within what their aborts leave open);
- success completion tokens == the tokens the clients were told + ABORT_TOKENS per aborted
  request the server finished anyway;
- resident memory (the server's `process_resident_memory_bytes`) back within a tolerance of the
  post-warm-up baseline.

Exit status 1 when any check fails.  `run_soak()` is the same as a function (tests use it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from quantserve.bench.soak_client import ABORT_TOKENS, ClientCounts, run_load

MiB = 1 << 20


@dataclass
class SoakConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000
    clients: int = 16
    duration_s: float = 15.0
    warmup_s: float = 4.0
    abort_fraction: float = 0.25  # of requests the client walks away from
    seed: int = 0
    api_key: str | None = None
    model: str | None = None  # default: the first id of /v1/models
    request_timeout_s: float = 120.0
    idle_timeout_s: float = 30.0
    # Resident memory may end this much above the post-warm-up baseline (see rss_tolerance()).
    rss_tolerance_mib: float | None = None


@dataclass
class SoakReport:
    config: dict
    clients: ClientCounts
    server: dict  # deltas of the server's counters over the measured phase, and its gauges after
    rss_baseline_mib: float | None
    rss_after_mib: float | None
    rss_peak_mib: float | None
    rss_tolerance_mib: float | None
    idle_after_s: float | None  # how long after the load the server reported itself idle
    elapsed_s: float
    problems: list[str]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["clients"]["aborted"] = self.clients.aborted
        return d


# ---- metrics --------------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or "name{label=value}": value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


OUTCOMES = ("success", "error", "disconnected", "rejected")
_COUNTERS = {"received": "quantserve:request_received_total",
             **{o: f"quantserve:request_outcome_total{{outcome={o}}}" for o in OUTCOMES},
             "success_tokens": "quantserve:request_completion_tokens_total{outcome=success}",
             "engine_generated_tokens": "quantserve:engine_generated_tokens_total",
             "engine_cancelled": "quantserve:engine_cancelled_requests_total",
             "rejected_429": "quantserve:request_rejected_total{status=429}"}
_GAUGES = {"running": "quantserve:num_requests_running", "waiting": "quantserve:num_requests_waiting",
           "kv_used_tokens": "quantserve:kv_cache_used_tokens"}
RSS = "process_resident_memory_bytes"


async def scrape(client, url: str) -> dict[str, float]:
    r = await client.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


def _settled(m: dict[str, float]) -> bool:
    """Idle: nothing running, waiting or cached, and every received request has an outcome."""
    idle = all(m.get(name, 0) == 0 for name in _GAUGES.values())
    return idle and m.get(_COUNTERS["received"], 0) == sum(m.get(_COUNTERS[o], 0) for o in OUTCOMES)


async def wait_settled(client, url: str, timeout: float) -> tuple[dict[str, float], float | None]:
    t0 = time.perf_counter()
    while True:
        m = await scrape(client, url)
        if _settled(m):
            return m, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return m, None
        await asyncio.sleep(0.1)


# ---- the soak -------------------------------------------------------------------------------------

def rss_tolerance(baseline_mib: float) -> float:
    """How far resident memory may end above the post-warm-up baseline: 10 % of it, at least 32 MiB.

    After the warm-up (the same load) the allocator pools (glibc arenas, Python's object arenas) have
    grown to this load's working set; measured, the soak then moves RSS by 0.5-2 MiB.  A leak grows
    with the request count instead: the quick soak (16 clients x 15 s) sends ~1 100 requests, so
    anything leaking more than ~30 KiB a request fails it (a slot never freed keeps 160-320 KiB of
    KV cache on the default model, 4 KiB a token), and the full one (64 x 120 s) sends ~13 000, so
    ~3 KiB a request.  Leaks the engine itself accounts for (slots, KV tokens) are caught exactly
    by the idle check anyway.
    """
    return max(32.0, 0.10 * baseline_mib)


def check(cfg: SoakConfig, c: ClientCounts, s: dict, rss: tuple, idle_s: float | None) -> list[str]:
    """Every problem found, in words; [] when the soak passed."""
    problems = []
    if c.unexpected:
        problems.append(f"{c.unexpected} unexpected errors, e.g. {c.unexpected_samples[:3]}")
    if idle_s is None:
        problems.append(f"server not idle {cfg.idle_timeout_s} s after the load: "
                        f"{ {k: s[k] for k in _GAUGES} }, received {s['received']} vs outcomes "
                        f"{ {o: s[o] for o in OUTCOMES} }")
    if s["error"]:
        problems.append(f"the server counted {s['error']:.0f} failed requests")
    if s["received"] != sum(s[o] for o in OUTCOMES):
        problems.append(f"received {s['received']} != success + error + disconnected + rejected "
                        f"({ {o: s[o] for o in OUTCOMES} })")
    # Each aborted request ends as exactly one of: disconnected, finished anyway (success),
    # refused unseen (rejected), or never read by the server at all.
    finished_anyway = s["success"] - c.completed
    unseen_429 = s["rejected"] - c.rejected_429
    never_read = c.sent - s["received"]
    for name, value in (("success - completed", finished_anyway), ("rejected - client 429s", unseen_429),
                        ("sent - received", never_read)):
        if not 0 <= value <= c.aborted:
            problems.append(f"{name} = {value:.0f}, outside [0, {c.aborted} aborted]")
    if s["disconnected"] + finished_anyway + unseen_429 + never_read != c.aborted:
        problems.append(f"aborted {c.aborted} != disconnected {s['disconnected']:.0f} + finished anyway "
                        f"{finished_anyway:.0f} + unseen 429s {unseen_429:.0f} + never read {never_read:.0f}")
    expected_tokens = c.completion_tokens + finished_anyway * ABORT_TOKENS
    if s["success_tokens"] != expected_tokens:
        problems.append(f"server success tokens {s['success_tokens']:.0f} != clients' {c.completion_tokens} "
                        f"+ {finished_anyway:.0f} x {ABORT_TOKENS} finished after an abort")
    if s["engine_generated_tokens"] < s["success_tokens"]:
        problems.append(f"the engine sampled {s['engine_generated_tokens']:.0f} tokens, fewer than the "
                        f"{s['success_tokens']:.0f} it delivered")
    base, after, tol = rss
    if base is not None and after is not None and after - base > tol:
        problems.append(f"resident memory {after:.1f} MiB after the load, baseline {base:.1f} MiB "
                        f"(tolerance {tol:.1f} MiB)")
    if c.completed == 0:
        problems.append("no request completed")
    return problems


async def _peak_rss(client, url: str, stop: asyncio.Event, peak: list[float]) -> None:
    while not stop.is_set():
        try:
            m = await scrape(client, url)
            if RSS in m:
                peak[0] = max(peak[0], m[RSS] / MiB)
        except Exception:  # a scrape lost under load is no finding; the checks scrape again
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run_soak_async(cfg: SoakConfig) -> SoakReport:
    import httpx

    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 8, max_keepalive_connections=cfg.clients + 8)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=cfg.request_timeout_s) as client:
        model = cfg.model or (await client.get(cfg.url + "/v1/models")).json()["data"][0]["id"]
        # warm-up: the same load, so the allocator pools reach their working size before the baseline
        if cfg.warmup_s > 0:
            await run_load(client, cfg.url, model, cfg.clients, cfg.abort_fraction, cfg.warmup_s, cfg.seed + 1)
        before, idle = await wait_settled(client, cfg.url, cfg.idle_timeout_s)
        problems = [] if idle is not None else ["server not idle after the warm-up"]
        base = before[RSS] / MiB if RSS in before else None
        stop, peak = asyncio.Event(), [base or 0.0]
        watcher = asyncio.create_task(_peak_rss(client, cfg.url, stop, peak))
        counts = await run_load(client, cfg.url, model, cfg.clients, cfg.abort_fraction, cfg.duration_s, cfg.seed)
        stop.set()
        await watcher
        after_m, idle_s = await wait_settled(client, cfg.url, cfg.idle_timeout_s)
    server = {k: after_m.get(name, 0.0) - before.get(name, 0.0) for k, name in _COUNTERS.items()}
    server.update({k: after_m.get(name, 0.0) for k, name in _GAUGES.items()})
    after = after_m[RSS] / MiB if RSS in after_m else None
    tol = cfg.rss_tolerance_mib if cfg.rss_tolerance_mib is not None else (rss_tolerance(base) if base else None)
    problems += check(cfg, counts, server, (base, after, tol), idle_s)
    return SoakReport(config=asdict(cfg) | {"api_key": None, "model": model}, clients=counts, server=server,
                      rss_baseline_mib=base, rss_after_mib=after, rss_peak_mib=peak[0] if base else None,
                      rss_tolerance_mib=tol, idle_after_s=idle_s, elapsed_s=time.perf_counter() - t0,
                      problems=problems)


def run_soak(cfg: SoakConfig) -> SoakReport:
    return asyncio.run(run_soak_async(cfg))


def summary(r: SoakReport) -> str:
    c, s, cfg = r.clients, r.server, r.config
    lines = [
        f"soak: {cfg['clients']} clients x {cfg['duration_s']:.0f} s against {cfg['url']} ({cfg['model']})",
        f"  clients: {c.sent} sent, {c.completed} completed ({c.completion_tokens} tokens), "
        f"{c.rejected_429} x 429, {c.aborted} aborted ({c.aborted_mid_stream} mid-stream, "
        f"{c.aborted_after_headers} after headers, {c.aborted_no_reply} before any reply), "
        f"{c.unexpected} unexpected errors",
        f"  server:  {s['received']:.0f} received = {s['success']:.0f} success + {s['error']:.0f} error + "
        f"{s['disconnected']:.0f} disconnected + {s['rejected']:.0f} rejected; "
        f"{s['success_tokens']:.0f} tokens delivered, {s['engine_generated_tokens']:.0f} sampled",
        f"  after:   running {s['running']:.0f}, waiting {s['waiting']:.0f}, KV tokens {s['kv_used_tokens']:.0f}"
        + (f" (idle {r.idle_after_s:.2f} s after the load)" if r.idle_after_s is not None else " (never idle)"),
    ]
    if r.rss_baseline_mib is not None:
        lines.append(f"  memory:  RSS {r.rss_baseline_mib:.1f} MiB after warm-up, peak {r.rss_peak_mib:.1f}, "
                     f"{r.rss_after_mib:.1f} after the load (tolerance +{r.rss_tolerance_mib:.1f} MiB)")
    lines.append("  PASSED" if not r.problems else "  FAILED:\n" + "\n".join(f"    - {p}" for p in r.problems))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0],
                                epilog="An API key, if the server wants one, is read from $QUANTSERVE_API_KEY.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of measured load")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up load (default: a tenth "
                   "of --duration, 3 to 15 s)")
    p.add_argument("--abort-fraction", type=float, default=0.25, help="share of requests the clients abandon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--rss-tolerance-mib", type=float, default=None,
                   help="allowed growth of resident memory (default: 10 %% of the baseline, at least 32 MiB)")
    p.add_argument("--out", default=None, help="write the full report as JSON here")
    a = p.parse_args(argv)
    if a.clients < 1 or not a.duration > 0 or not 0 <= a.abort_fraction <= 1:
        p.error("--clients at least 1, --duration above 0, --abort-fraction in [0, 1]")
    warmup = a.warmup if a.warmup is not None else min(15.0, max(3.0, a.duration / 10))
    cfg = SoakConfig(url=a.url.rstrip("/"), clients=a.clients, duration_s=a.duration, warmup_s=warmup,
                     abort_fraction=a.abort_fraction, seed=a.seed, model=a.model,
                     api_key=os.environ.get("QUANTSERVE_API_KEY"), rss_tolerance_mib=a.rss_tolerance_mib)
    import httpx

    try:
        report = run_soak(cfg)
    except httpx.TransportError as e:  # no server there: one line, not a traceback
        print(f"error: cannot reach {cfg.url}: {e}", file=sys.stderr)
        return 1
    print(summary(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
