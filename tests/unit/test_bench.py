"""bench/serve.py against a real OpenAI-compatible server (llama.cpp's, on the default model's
GGUF), its metric definitions recomputed independently from the recorded timings, the plot, and
bench/decode.py --quick and bench/zero_scaling.py --quick end to end, and
bench/default_model_sweep.py's argument check and table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from quantserve.bench import serve as bs
from quantserve.bench import serve_client as sc
from quantserve.settings import free_port


@pytest.fixture(scope="module")
def llama_server(default_model, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("sse_starlette", reason="llama_cpp.server needs llama-cpp-python[server]")
    import httpx

    from quantserve.quant.convert import convert

    out = convert(default_model, "gguf-f16", tmp_path_factory.mktemp("gguf") / "f16", progress=False)
    gguf = next(out.glob("*.gguf"))
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
                             "--host", "127.0.0.1", "--n_ctx", "512", "--n_threads", "1",
                             # its default stops the running request whenever another one arrives
                             "--interrupt_requests", "False"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(120):
            try:
                if httpx.get(base + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "llama_cpp.server exited at start-up"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def serve_result(llama_server, tmp_path_factory):
    from quantserve.demo import corpus

    d = tmp_path_factory.mktemp("serve")
    prompts = d / "prompts.jsonl"  # pretraining questions: the default model goes on for a while
    qs = [e.prompt for e in corpus.pretrain_examples(40, 0) if e.prompt.startswith("What is the")][:6]
    prompts.write_text("".join(json.dumps({"prompt": q.rsplit(" ", 1)[0]}) + "\n" for q in qs))
    out = d / "llamacpp.json"
    code = bs.main(["--base-url", llama_server, "--corpus", str(prompts), "--concurrency", "1,3",
                    "--num-prompts", "6", "--output-len", "8", "--save-records", "--label", "llama.cpp f16",
                    "--out", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def test_serve_against_llama_cpp_server(serve_result):
    assert [r["concurrency"] for r in serve_result["runs"]] == [1, 3]
    for run in serve_result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        for rec in run["records"]:
            assert 0 <= rec["output_tokens"] <= 8
            if rec["output_tokens"]:
                assert 0 < rec["ttft"] <= rec["chunk_times"][-1] <= rec["latency"]
        assert run["output_throughput"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"]
        assert all(0 <= rec["sent"] <= run["duration_s"] for rec in run["records"])
    one_at_a_time = sorted(serve_result["runs"][0]["records"], key=lambda r: r["sent"])
    for before, after in zip(one_at_a_time, one_at_a_time[1:]):  # concurrency 1: each sent after the last ended
        assert after["sent"] >= before["sent"] + before["latency"]


def test_metrics_recomputed_from_recorded_timings(serve_result):
    """vLLM's definitions, recomputed with numpy from the real per-request records."""
    for run in serve_result["runs"]:
        recs = [sc.Record(**r) for r in run["records"]]
        m = bs.compute_metrics(recs, run["duration_s"])
        ttft = np.array([r.ttft for r in recs if r.ttft is not None])
        tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in recs if r.output_tokens > 1])
        itl = np.concatenate([np.diff(r.chunk_times) for r in recs])
        assert sum(r.output_tokens for r in recs) > 0
        assert m["ttft_ms"]["mean"] == pytest.approx(ttft.mean() * 1e3)
        assert m["ttft_ms"]["median"] == pytest.approx(np.median(ttft) * 1e3)
        assert m["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttft, 99) * 1e3)
        if len(tpot):
            assert m["tpot_ms"]["p99"] == pytest.approx(np.percentile(tpot, 99) * 1e3)
        assert m["itl_ms"]["median"] == pytest.approx(np.median(itl) * 1e3)
        assert m["output_throughput"] == pytest.approx(sum(r.output_tokens for r in recs) / run["duration_s"])
        assert m["request_throughput"] == pytest.approx(len(recs) / run["duration_s"])
        assert m == {k: v for k, v in run.items() if k in m}


def test_failed_requests_are_counted_not_averaged():
    ok = sc.Record(ok=True, output_tokens=3, ttft=0.1, latency=0.3, chunk_times=[0.1, 0.2, 0.3])
    bad = sc.Record(error="HTTP 429: busy")
    m = bs.compute_metrics([ok, bad], 1.0)
    assert (m["completed"], m["failed"], m["output_tokens"]) == (1, 1, 3)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0) and m["errors"] == ["HTTP 429: busy"]


def test_answers_shorter_than_asked_are_counted():
    """With --ignore-eos every answer should have output_len tokens; fewer means the server ignored
    it or cut the request (llama-cpp-python's server does when a new request arrives)."""
    full = sc.Record(ok=True, output_tokens=8, ttft=0.1, latency=0.8, chunk_times=[0.1 * i for i in range(1, 9)])
    cut = sc.Record(ok=True, output_tokens=2, ttft=0.1, latency=0.2, chunk_times=[0.1, 0.2])
    assert bs.compute_metrics([full, cut], 1.0, output_len=8)["short_outputs"] == 1
    assert bs.compute_metrics([full, cut], 1.0)["short_outputs"] is None


def test_plot(serve_result, tmp_path):
    from PIL import Image

    from quantserve.bench.plot import plot

    a = tmp_path / "a.json"
    a.write_text(json.dumps(serve_result))
    png = plot([str(a), str(a)], str(tmp_path / "p.png"), ["ours", "llama.cpp"])
    assert Image.open(png).size[0] > 500


def test_ttft_cdf_plot_needs_the_records(serve_result, tmp_path):
    from PIL import Image

    from quantserve.bench.plot import ttft_cdf

    a, bare = tmp_path / "a.json", tmp_path / "bare.json"
    a.write_text(json.dumps(serve_result))
    bare.write_text(json.dumps({**serve_result, "runs": [{k: v for k, v in r.items() if k != "records"}
                                                         for r in serve_result["runs"]]}))
    assert Image.open(ttft_cdf([str(a)], str(tmp_path / "c.png"))).size[0] > 500
    with pytest.raises(ValueError, match="--save-records"):
        ttft_cdf([str(a), str(bare)], str(tmp_path / "d.png"))


def test_decode_quick(tmp_path):
    from quantserve.bench.decode import main

    out = tmp_path / "d.json"
    assert main(["--quick", "--new-tokens", "10", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["new_tokens"] == 10 and res["settings"]["prompt_len"] == 16  # given kept, rest quick's
    engines = {(r["engine"], r["batch"]) for r in res["rows"] if "tok_s" in r}
    assert {("generate", 1), ("fastcore-fp32", 1), ("fastcore-int8", 4), ("fastcore-int4", 1)} <= engines
    assert not [r for r in res["rows"] if "error" in r]
    assert all(0 < r["roofline_pct"] for r in res["rows"])
    assert res["bandwidth_Bps"] > 1e8


def test_zero_scaling_quick(tmp_path):
    """bench/zero_scaling.py on the CPU: ZeRO-2/3 on 1 and 2 gloo processes with the same global
    batch reach the same weights (fp32: a two-term sum is the same in either order)."""
    out = tmp_path / "zs"
    subprocess.run([sys.executable, "-m", "quantserve.bench.zero_scaling", "--quick", "--out", str(out)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    res = json.loads((out / "zero_scaling.json").read_text())
    assert (out / "zero_scaling.png").stat().st_size > 10_000
    # a failed run's exit code and its log's last lines in the message (one two-process ZeRO-3 run
    # once aborted under a loaded CI machine: the next one should say why)
    assert [(r["zero"], r["nproc"], r["status"]) for r in res["rows"]] == \
        [(2, 1, "ok"), (2, 2, "ok"), (3, 1, "ok"), (3, 2, "ok")], [r for r in res["rows"] if r["status"] != "ok"]
    assert all(r["global_step"] == res["steps"] for r in res["rows"])
    for c in res["checks"]:
        assert c["update_norm"] > 0.1  # the runs trained
        assert c["relative_diff"] < 1e-5 and c["max_loss_rel_diff"] < 1e-5 and c["probe_top1_equal"], c


def test_serve_against_nothing_is_one_line_and_exit_1(capsys):
    from quantserve.bench.serve import main

    assert main(["--base-url", "http://127.0.0.1:9/v1", "--concurrency", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot reach http://127.0.0.1:9/v1/models")


@pytest.mark.parametrize("client", sc.CLIENTS)
def test_failed_requests_make_the_run_exit_1(llama_server, capsys, client):
    """Prompts longer than the server's 512-token context: every request fails, the table shows it
    and the exit code says the figures are not a clean measurement (with either HTTP client)."""
    code = bs.main(["--base-url", llama_server, "--concurrency", "1", "--num-prompts", "2", "--input-len", "600",
                    "--output-len", "4", "--no-warmup", "--client", client])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: 2 of 2 requests failed, e.g. "), err


@pytest.mark.parametrize("name", ["decode", "serve", "kernels", "plot"])
def test_bench_help_names_its_command(name):
    proc = subprocess.run([sys.executable, "-m", "quantserve", "bench", name, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith(f"Usage: quantserve bench {name}"), proc.stdout[:200]
    # every option says what it does: click prints its help on the option's line or the next
    lines = proc.stdout.split("Options:", 1)[1].splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s{2}-", line):
            described = re.match(r"\s{2}-\S.*?\s{2,}\S", line) or (
                i + 1 < len(lines) and re.match(r"\s{10,}\S", lines[i + 1]))
            assert described, f"bench {name}: {line.strip()} has no help"
    # and every option that has a default shows it: click's "[default: ...]" or the help's own words
    from typer.main import get_command

    from quantserve.cli import app

    command = get_command(app).commands["bench"].commands[name]
    ctx = command.context_class(command, info_name=name)
    for param in command.params:
        if param.default not in (None, False):
            assert "default" in param.get_help_record(ctx)[1], f"bench {name}: {param.opts} shows no default"


def test_gpu_bench_refuses_a_cpu_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    for extra in ([], ["--quick", "--models", "8b"]):  # --quick keeps a given --models (it silently ran tiny)
        proc = subprocess.run([sys.executable, "-m", "quantserve", "bench", "decode", *extra], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
            "error: bench decode measures the 1B/8B shapes on a CUDA GPU; on a CPU use --quick (without --models)"]


def test_bench_decode_checks_its_output_before_measuring(tmp_path):
    """A path it cannot write is one line at once, not after the whole run (its figures lost)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "quantserve", "bench", "decode", "--quick", "--out",
                           str(blocker / "decode.json")], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: --out {blocker}"), proc.stderr
    assert "tokens/s" not in proc.stdout and time.time() - t0 < 60


def test_kernel_bench_refuses_a_cpu_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    proc = subprocess.run([sys.executable, "-m", "quantserve", "bench", "kernels", "--batches", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == ["error: bench kernels needs a CUDA GPU"]
    bad = subprocess.run([sys.executable, "-m", "quantserve", "bench", "kernels", "--kinds", "int3-magic"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "choose from" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_replicas_compare_tables_the_rounds_and_says_what_is_missing(tmp_path, capsys):
    """bench/replicas_compare.py over `bench serve`-shaped results: the median of each round's ratio."""
    from quantserve.bench.replicas_compare import main

    def result(name: str, tput: float, ttft: float) -> None:
        runs = [{"concurrency": 1, "output_throughput": tput, "ttft_ms": {"mean": ttft}, "failed": 0}]
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": runs}))

    with pytest.raises(SystemExit, match="no bare-N.json and ray-N.json"):
        main([str(tmp_path)])
    for n, (bare, ray) in enumerate([(100, 99), (100, 90), (100, 98)], start=1):
        result(f"bare-{n}", bare, 10.0)
        result(f"ray-{n}", ray, 10.4)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | `--replicas 1` | 99.0 / 90.0 / 98.0 | **0.980×** |" in out and "**1.040×** | +0.40 |" in out
    assert "throughput ≥ 0.97× met, TTFT ≤ 1.05× met" in out
    (tmp_path / "ray-4.json").write_text("{not json")
    with pytest.raises(SystemExit, match="ray-4.json is not a `bench serve` result"):
        main([str(tmp_path)])


def test_both_http_clients_read_the_same_streams(llama_server):
    """aiohttp (the default) and httpx (the client of earlier figures) see the same tokens of the
    same greedy streams, and the same usage."""
    import asyncio

    model = bs.served_model(llama_server, None)
    prompts = bs.make_prompts(4, 12, 0)
    seen = {}
    for client in sc.CLIENTS:
        records, _ = asyncio.run(sc.run_level(llama_server, model, prompts, 2, 6, False, False, None, 60,
                                              client=client))
        assert all(r.ok for r in records), [r.error for r in records]
        seen[client] = [(r.output_tokens, r.prompt_tokens, len(r.chunk_times)) for r in records]
    assert seen["aiohttp"] == seen["httpx"]


def test_a_kept_alive_connection_the_server_closed_is_retried_once():
    """A server that answers keep-alive but closes each connection after its answer (as
    llama.cpp's server did under 32 streams): every request still completes, on a new connection,
    with the aiohttp client; a server that drops every request still fails them."""
    import asyncio

    answer = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":3,'
              b'"completion_tokens":1}}\n\ndata: [DONE]\n\n')

    async def run(drop_all: bool) -> list:
        async def handle(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
            await reader.readexactly(length)
            if not drop_all:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
                await asyncio.sleep(0.02)  # the client has put the connection back in its pool by now
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            records, _ = await sc.run_level(f"http://127.0.0.1:{port}/v1", "m", ["x"] * 24, 8, 4, chat=False,
                                            ignore_eos=True, api_key=None, timeout=10, client="aiohttp")
        return records

    pytest.importorskip("aiohttp")
    records = asyncio.run(run(drop_all=False))
    assert [r.ok for r in records] == [True] * 24, [r.error for r in records]
    dropped = asyncio.run(run(drop_all=True))
    assert not any(r.ok for r in dropped) and all("ServerDisconnected" in r.error for r in dropped)


def test_sweep_refuses_unknown_data_sizes_in_one_line(capsys, tmp_path):
    """bench/default_model_sweep.py: a misspelt --data size fails before any run starts (the other
    arguments keep a run that did start short)."""
    from quantserve.bench import default_model_sweep as sweep

    with pytest.raises(SystemExit) as exc:
        sweep.main(["--data", '{"n_tool_trian": 2000}', "--seeds", "0", "--threads", "1", "--noise", "0",
                    "--jobs", "1", "--out", str(tmp_path / "rows.json"), "--train", '{"max_steps": 1}'])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown ['n_tool_trian']" in err[0] and "n_tool_train" in err[0], err


def test_sweep_table_shows_the_tool_calls_and_their_worst_case():
    from quantserve.bench.default_model_sweep import markdown

    row = {"stage": "finetune", "seed": 0, "threads": 1, "noise": 0.0, "task_after": 1.0,
           "skills_after": {"count": 1.0}, "finetune_s": 500}
    table = markdown([{**row, "tool_after": 0.965}, {**row, "seed": 1, "tool_after": 1.0}, {**row, "seed": 2}])
    lines = table.splitlines()
    assert "tool calls after" in lines[0]
    assert "| 96.5% |" in lines[2] and "| 100.0% |" in lines[3] and "| – |" in lines[4]  # a row without the score
    assert "worst fine-tuned tool-call accuracy: 96.5% (bar 90%)" in table


def test_startup_profile_splits_the_start_into_parts_and_imports(tmp_path, capsys):
    """bench/startup_profile.py on a raw py-spy profile: the engine thread's samples by part, its
    imports split into compiling source, reading bytecode and running modules; other threads ignored."""
    from quantserve.bench import startup_profile

    boot = "thread (1): uvloop_0;load (api_server.py:245);ScheduledEngine.start (engines.py:201)"
    imp = "_find_and_load (<frozen importlib._bootstrap>:1360);<module> (torch/_dynamo/__init__.py:13)"
    raw = tmp_path / "pyspy.txt"
    raw.write_text("\n".join([
        f"{boot};load_fast (loader.py:40);FastCore.__init__ (core.py:98);open_weights (weights.py:45);{imp};"
        "SourceLoader.get_code (<frozen importlib._bootstrap_external>:1);SourceLoader.source_to_code (x:1) 300",
        f"{boot};load_fast (loader.py:40);FastCore.__init__ (core.py:98);open_weights (weights.py:45);{imp};"
        "SourceLoader.get_code (<frozen importlib._bootstrap_external>:1) 50",
        f"{boot};load_fast (loader.py:40);FastCoreBackend.__init__ (adapter.py:30);FastCore.warm_up (core.py:300) 200",
        "thread (2): MainThread;Server.run (server.py:1) 1000",
    ]) + "\n")
    assert startup_profile.main([str(raw)]) == 0
    out = capsys.readouterr().out
    assert "start-up thread,    5.50 s" in out
    assert "3.50 s  open_weights" in out and "2.00 s  FastCore.warm_up" in out
    assert "importing:    3.50 s" in out and "3.00 s  compiling source" in out and "0.50 s  reading bytecode" in out
    assert "3.50 s  torch/_dynamo/__init__.py" in out
    with pytest.raises(SystemExit, match="no such file"):
        startup_profile.main([str(tmp_path / "missing.txt")])


def test_attention_split_bench_refuses_a_cpu_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    proc = subprocess.run([sys.executable, "-m", "quantserve.bench.attention_split", "--batches", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: the attention kernel's timing needs a CUDA GPU"]


def test_attention_split_refuses_a_bad_decode_tile_before_timing():
    proc = subprocess.run([sys.executable, "-m", "quantserve.bench.attention_split", "--decode-tiles", "64x4,64x3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "error: --decode-tiles='64x3': use KEYSxWARPS, keys 16-256 and warps 1-16, each a power of two (e.g. 64x4)")


def test_attention_split_plots_a_saved_run_without_a_gpu(tmp_path):
    rows = [{"shape": "8b", "batch": b, "context": c, "split_us": 7.0 + c / 100, "one_program_us": 5.0 + c / 30}
            for b in (1, 32) for c in (64, 128, 256)]
    rows += [{**r, "tile": "128x8", "one_program_us": r["one_program_us"] - 1} for r in rows]  # two tiles
    saved, png = tmp_path / "rows.json", tmp_path / "split.png"
    saved.write_text(json.dumps(rows))
    run = [sys.executable, "-m", "quantserve.bench.attention_split", "--rows"]
    proc = subprocess.run(run + [str(saved), "--plot", str(png)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr
    bad = subprocess.run(run + [str(png), "--plot", str(tmp_path / "x.png")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_quick_sizes_keep_what_the_command_line_gave():
    """--quick sets its small sizes only where none was given (it silently replaced --steps and the like)."""
    import argparse

    from quantserve.bench.args import quick_sizes

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=4096)
    args = ap.parse_args(["--steps", "7"])
    quick_sizes(args, ap, steps=2, seq_len=128)
    assert (args.steps, args.seq_len) == (7, 128)
