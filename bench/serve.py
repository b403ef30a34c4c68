"""Load generator for any OpenAI-compatible server: TTFT, TPOT, ITL and throughput vs concurrency.

    quantserve bench serve --base-url http://127.0.0.1:8000/v1 --concurrency 1,8,32,64 \
        --input-len 128 --output-len 128 --out bench/results/serve-ours.json

Definitions are vLLM `bench serve`'s: TTFT = time to the first streamed token; TPOT = (latency -
TTFT) / (output tokens - 1), per request; ITL = the gaps between streamed chunks, pooled over
requests; request and output-token throughput = totals over the wall time of the whole run.  Each
is reported as mean / median / p99.

The same command runs unchanged against our server and against `python -m llama_cpp.server`: it
streams `/v1/completions` (or `/v1/chat/completions` with --chat) over plain HTTP.  Output tokens
are the server's `usage.completion_tokens` when it sends usage, else the number of streamed chunks
with text (one token each on both servers).  Prompts are fixed-length random words from a seeded
generator (about one token per word with a BPE tokenizer) or lines of a corpus file; each
concurrency level sends prompts no earlier level sent (a corpus with fewer lines than all the
levels' prompts repeats them), so a server's prefix cache finds none of them.

The client is aiohttp, as vLLM's benchmark's: its C parser keeps the client's own time per streamed
event small, which at thousands of events a second is otherwise part of what is measured (httpx,
pure Python, the client of this file's figures before 2026-12-04 evening: `--client httpx`).

`--shared-prefix-len N` puts one N-word system text before every prompt (as a system message with
--chat): the load of many users of one application, which a server's prefix cache serves without
recomputing the shared part.  `cached_tokens` sums what the server said it took from its cache
(`usage.prompt_tokens_details.cached_tokens`, where it sends it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from quantserve.bench.args import existing_file, require_writable_output
from quantserve.bench.serve_client import Record, run_level
from quantserve.settings import UserError

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be "
         "also or had first one their its new after who they two her she been other when there all "
         "during into school time may years more most only over city some world would where later up "
         "such used many can state about national out known university united then made").split()


@dataclass(frozen=True)
class ServeOptions:
    """One run of `quantserve bench serve`: its options (the command's defaults are these), kept
    in the result JSON as `settings`."""
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # default: the first of /v1/models
    label: str | None = None  # default: the model id
    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    num_prompts: int = 0  # per level; 0: max(16, 4 x concurrency)
    input_len: int = 128
    output_len: int = 128
    corpus: str | None = None
    shared_prefix_len: int = 0
    chat: bool = False
    ignore_eos: bool = False
    json_schema: dict | None = None  # the schema itself (json_schema_arg reads it)
    api_key: str | None = None
    seed: int = 0
    timeout: float = 600
    no_warmup: bool = False
    out: str | None = None
    save_records: bool = False
    client: str = "aiohttp"  # or "httpx" (the client of earlier figures): serve_client.CLIENTS


def make_prompts(n: int, input_len: int, seed: int, corpus: str | None = None) -> list[str]:
    rng = random.Random(seed)
    if corpus:
        try:
            lines = [ln.strip() for ln in Path(corpus).read_text(encoding="utf-8").splitlines() if ln.strip()]
        except UnicodeDecodeError as e:  # its own text names no file
            raise UserError(f"{corpus}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        texts = []
        for ln in lines:
            try:  # JSONL (our corpus files: {"prompt": ...} or {"text": ...}) or plain text lines
                obj = json.loads(ln)
                ln = obj.get("prompt") or obj.get("text") or ln
            except (json.JSONDecodeError, AttributeError):
                pass
            words = str(ln).split()  # keep the text as written (newlines matter) unless too long
            texts.append(" ".join(words[:input_len]) if len(words) > input_len else str(ln))
        if not texts:
            raise UserError(f"{corpus}: no lines of text to make prompts of")
        rng.shuffle(texts)
        return [texts[i % len(texts)] for i in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def _stats(values: list[float], scale: float = 1e3) -> dict:
    """mean / median / p99 (linear interpolation, numpy's default) in ms."""
    if not values:
        return {"mean": None, "median": None, "p99": None}
    v = sorted(values)
    k = (len(v) - 1) * 0.99
    lo = int(k)
    p99 = v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)
    return {"mean": statistics.fmean(v) * scale, "median": statistics.median(v) * scale, "p99": p99 * scale}


def compute_metrics(records: list[Record], duration: float, output_len: int | None = None) -> dict:
    """Metrics of one level.  `output_len` (with --ignore-eos) counts the answers that came back
    shorter: a server that ignores `ignore_eos`, or cuts requests short, would look fast otherwise."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    # a reply whose tokens carry no text (ids a random checkpoint's tokenizer cannot spell) has no TTFT
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens or None,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "short_outputs": sum(r.output_tokens < output_len for r in ok) if output_len else None,
    }


# `--json-schema fixed-length`: an array longer than any --output-len, so every structured reply
# runs to max_tokens exactly as an ignore_eos free-text one does: the two rates compare like for like.
FIXED_LENGTH_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                       "minItems": 100_000}


def json_schema_arg(value: str) -> dict:
    """`fixed-length` or a JSON schema file: the schema (the parser of --json-schema)."""
    if value == "fixed-length":
        return FIXED_LENGTH_SCHEMA
    try:
        return json.loads(Path(existing_file(value)).read_text())
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"{value}: not JSON ({e})") from None


class ServerNotUsable(UserError):
    """The endpoint cannot be benchmarked (unreachable, an error reply, no models)."""


def served_model(base_url: str, api_key: str | None, wait_s: float = 600) -> str:
    """The first model id of /v1/models, waiting up to `wait_s` while the server answers 503
    (still loading: a fast engine compiles for minutes before it serves)."""
    import httpx

    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = httpx.get(url, headers=headers, timeout=30)
        except httpx.HTTPError as e:
            raise ServerNotUsable(f"cannot reach {url}: {type(e).__name__}: {e}") from e
        if r.status_code == 503 and time.monotonic() < deadline:
            time.sleep(1)
            continue
        if r.status_code != 200:
            raise ServerNotUsable(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            return r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServerNotUsable(f"{url} did not list a model: {r.text[:200]}") from None


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"serve: {result['label']} @ {result['base_url']} ({result['model']})")
    cols = ["conc", "ok/fail", "req/s", "out tok/s", "TTFT mean/med/p99 ms", "TPOT mean/med/p99 ms",
            "ITL mean/med/p99 ms"]
    for c in cols:
        t.add_column(c, justify="right")
    f = lambda d: "/".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("mean", "median", "p99"))  # noqa: E731
    for r in result["runs"]:
        t.add_row(str(r["concurrency"]), f"{r['completed']}/{r['failed']}",
                  f"{r['request_throughput'] or 0:.2f}", f"{r['output_throughput'] or 0:.1f}",
                  f(r["ttft_ms"]), f(r["tpot_ms"]), f(r["itl_ms"]))
    Console(width=160).print(t)


def run(o: ServeOptions) -> None:
    """Load the server at each concurrency level of `o`, writing `o.out` after each level; raises
    UserError when the server cannot be benchmarked or some requests failed (the JSON is written)."""
    if o.out:
        require_writable_output(o.out)
    if o.corpus:
        make_prompts(1, o.input_len, o.seed, o.corpus)  # an empty corpus fails now, not after the warm-up
    model = o.model or served_model(o.base_url, o.api_key, o.timeout)
    result = {"label": o.label or model, "base_url": o.base_url, "model": model,
              "settings": {**asdict(o), "api_key": "***" if o.api_key else None}, "runs": []}  # never the key
    if not o.no_warmup:
        recs, _ = asyncio.run(run_level(o.base_url, model, make_prompts(1, o.input_len, o.seed + 1),
                                        1, 8, o.chat, o.ignore_eos, o.api_key, o.timeout, client=o.client))
        if not recs[0].ok:
            raise UserError(f"the warm-up request failed: {recs[0].error}")
    # its own generator: the prompts after it are the same with or without it
    prefix = make_prompts(1, o.shared_prefix_len, o.seed + 1000)[0] if o.shared_prefix_len else None
    # each level its own prompts, the next ones of one seeded sequence: a level that re-sent an
    # earlier level's prompts would find them in the server's prefix cache (an 8B run's c = 8 level
    # had 49 % of its prompt tokens cached that way), and time cached prefills
    sizes = [o.num_prompts or max(16, 4 * c) for c in o.concurrency]
    unsent = iter(make_prompts(sum(sizes), o.input_len, o.seed, o.corpus))
    for c, n in zip(o.concurrency, sizes):
        prompts = list(itertools.islice(unsent, n))
        records, duration = asyncio.run(run_level(o.base_url, model, prompts, c, o.output_len, o.chat,
                                                  o.ignore_eos, o.api_key, o.timeout, o.json_schema, prefix,
                                                  o.client))
        fixed = o.ignore_eos or o.json_schema is FIXED_LENGTH_SCHEMA
        m = {"concurrency": c, "num_prompts": n,
             **compute_metrics(records, duration, o.output_len if fixed else None)}
        if o.save_records:
            m["records"] = records_to_json(records)
        result["runs"].append(m)
        short = f", {m['short_outputs']} shorter than {o.output_len} tokens" if m["short_outputs"] else ""
        print(f"concurrency {c}: {m['completed']} ok, {m['failed']} failed{short}, "
              f"{m['output_throughput'] or 0:.1f} out tok/s, TPOT p99 {m['tpot_ms']['p99'] or 0:.1f} ms", flush=True)
        if o.out:
            Path(o.out).parent.mkdir(parents=True, exist_ok=True)
            Path(o.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    c1 = next((r for r in result["runs"] if r["concurrency"] == 1), None)
    for r in result["runs"]:
        if c1 and r is not c1 and c1["output_throughput"]:
            r["vs_concurrency_1"] = r["output_throughput"] / c1["output_throughput"]
    if o.out:
        Path(o.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {o.out}")
    failed = sum(r["failed"] for r in result["runs"])
    if failed:  # the figures above leave those requests out: not a clean measurement
        first = next((e for r in result["runs"] for e in r["errors"]), "no message")
        raise UserError(f"{failed} of {sum(r['num_prompts'] for r in result['runs'])} requests failed, "
                        f"e.g. {first}")


def main(argv: list[str] | None = None) -> int:
    """`python -m quantserve.bench.serve ARGS` (the bench/*.sh scripts run it so) is
    `quantserve bench serve ARGS`; returns the exit code."""
    from quantserve.bench.cli import script_main

    return script_main("serve", argv)


def records_to_json(records: list[Record]) -> list[dict]:
    return [asdict(r) for r in records]


if __name__ == "__main__":
    sys.exit(main())
