"""Soak: many concurrent clients against a real server for a while, with random disconnects
(`bench/soak.py` does the load and the checks; this runs it and keeps the figures).

Nothing may be lost: zero unexpected errors (a 429 with Retry-After is the only accepted refusal),
every request the client did not abandon completes with a valid body, the server's counters add up
to what the clients saw, and afterwards no slot, queue entry or KV-cache token is left and resident
memory is back near its post-warm-up baseline.

QUANTSERVE_RELIABILITY=quick (default): 16 clients x 15 s on the hf engine and 16 x 8 s on gguf;
full: 64 clients x 120 s on each.
"""

from __future__ import annotations

import psutil
import pytest

from quantserve.bench.soak import ABORT_TOKENS, SoakConfig, rss_tolerance, run_soak, summary
from tests.support.figures import FULL, SIZE, Figures
from tests.support.servers import ServerProcess

# A small batch and queue next to many clients, so admission, queueing and 429s all happen.
SIZES = {"hf": dict(clients=64, duration_s=120.0, warmup_s=15.0, batch=16, queue=32) if FULL
         else dict(clients=16, duration_s=15.0, warmup_s=4.0, batch=8, queue=4),
         "gguf": dict(clients=64, duration_s=120.0, warmup_s=15.0, batch=16, queue=32) if FULL
         else dict(clients=16, duration_s=8.0, warmup_s=3.0, batch=8, queue=4)}


@pytest.fixture(scope="module")
def figures():
    f = Figures("soak")
    yield f
    f.write()


@pytest.fixture(scope="module")
def gguf_model(default_model, tmp_path_factory):
    from quantserve.quant.convert import convert

    out = convert(default_model, "gguf-q8_0", tmp_path_factory.mktemp("soak") / "q8", progress=False)
    return out / "model.gguf"


@pytest.mark.parametrize("engine", ["hf", "gguf"])
def test_soak_loses_nothing(engine, default_model, request, figures):
    size = SIZES[engine]
    model = default_model if engine == "hf" else request.getfixturevalue("gguf_model")
    srv = ServerProcess(model, "--max-batch", str(size["batch"]), "--max-queue", str(size["queue"]),
                        name="tiny")
    try:
        report = run_soak(SoakConfig(url=srv.base_url, clients=size["clients"], duration_s=size["duration_s"],
                                     warmup_s=size["warmup_s"], seed=7))
        rss_now = psutil.Process(srv.proc.pid).memory_info().rss / 2**20
        alive = srv.proc.poll() is None
    finally:
        rc = srv.stop()
    c, s = report.clients, report.server
    add = lambda what, figure: figures.add(f"{engine}: {what}", figure)  # noqa: E731
    add("size", f"{SIZE}: {size['clients']} clients x {size['duration_s']:.0f} s (after {size['warmup_s']:.0f} s "
        f"warm-up), --max-batch {size['batch']} --max-queue {size['queue']}")
    add("requests sent", c.sent)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(c.by_kind.items()))
    add("completed with a valid body", f"{c.completed} ({kinds})")
    add("disconnected by the client", f"{c.aborted} ({c.aborted_mid_stream} mid-stream, {c.aborted_after_headers} "
        f"after the headers, {c.aborted_no_reply} before any reply)")
    add("429 queue full (accepted, with Retry-After)", c.rejected_429)
    add("unexpected errors (client)", c.unexpected)
    add("server: received = success + error + disconnected + rejected", f"{s['received']:.0f} = "
        f"{s['success']:.0f} + {s['error']:.0f} + {s['disconnected']:.0f} + {s['rejected']:.0f}")
    add("server: aborted requests it finished anyway", f"{s['success'] - c.completed:.0f}")
    add("tokens: server-delivered = client-seen + finished-after-abort x ABORT_TOKENS",
        f"{s['success_tokens']:.0f} = {c.completion_tokens} + {s['success'] - c.completed:.0f} x {ABORT_TOKENS}")
    add("tokens sampled by the engine (includes abandoned work)", f"{s['engine_generated_tokens']:.0f}")
    add("after the load: running / waiting / KV-cache tokens",
        f"{s['running']:.0f} / {s['waiting']:.0f} / {s['kv_used_tokens']:.0f} "
        f"(idle {report.idle_after_s if report.idle_after_s is None else round(report.idle_after_s, 2)} s after)")
    add("RSS MiB: post-warm-up baseline / peak / after (tolerance)",
        f"{report.rss_baseline_mib:.1f} / {report.rss_peak_mib:.1f} / {report.rss_after_mib:.1f} "
        f"(+{report.rss_tolerance_mib:.1f})")
    add("problems", len(report.problems))

    assert alive and rc == 0, srv.log()
    assert report.problems == [], summary(report)
    # the checks above are only worth something if every path really ran
    assert c.aborted_mid_stream and c.aborted_after_headers and c.aborted_no_reply, summary(report)
    assert s["disconnected"] > 0 and len(c.by_kind) == 4, summary(report)
    assert report.rss_tolerance_mib == rss_tolerance(report.rss_baseline_mib)
    # /metrics reports the server's own resident memory: psutil agrees (pages may move a little)
    assert abs(rss_now - report.rss_after_mib) < 16, (rss_now, report.rss_after_mib)
