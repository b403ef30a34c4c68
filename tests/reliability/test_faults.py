"""Fault injection, for real: processes killed with SIGKILL, a server out of memory under an
address-space limit, model files rewritten under a running server, clients killed mid-stream.
Each test checks that nothing was lost and writes its figures to runs/reliability/faults.json.

- `quant convert` killed at several points: never an output that looks valid but is not; a rerun
  succeeds and leaves nothing behind; a `--force` replacement killed anywhere keeps a whole output.
- training killed while it writes a checkpoint: the next run resumes from the one before (a kill
  between checkpoints is tests/train/test_train_runs.py::test_sigkill_then_resume_matches_an_uninterrupted_run).
- out of memory: the request gets a 503 `out_of_memory`, the others keep being served.
- a failing decode step: an error reply (500, or an error event in a stream), never a short
  completion that looks successful.
- the served model file overwritten, truncated, deleted or replaced: the server is unaffected.
- clients SIGKILLed mid-stream, again and again: no slot or KV cache leaks.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.support.figures import FULL, Figures
from tests.support.servers import ServerProcess, collect_stream

QUANT = str(Path(sys.executable).parent / "quant")


@pytest.fixture(scope="module")
def figures():
    f = Figures("faults")
    yield f
    f.write()


def outcomes(srv: ServerProcess) -> dict[str, float]:
    text = httpx.get(srv.base_url + "/metrics").text
    return {o: float(line.rsplit(" ", 1)[1]) for o in ("success", "error", "disconnected", "rejected")
            for line in text.splitlines() if line.startswith(f'quantserve:request_outcome_total{{outcome="{o}"}}')}


# ---- a. quant convert killed ------------------------------------------------------------------------

def output_state(out: Path) -> str:
    """"absent", "complete: FORMAT" (manifest, `quant inspect` passes, every listed file present and
    the sizes the manifest records), or what is wrong with it."""
    if not out.exists():
        return "absent"
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return f"a folder without manifest: {sorted(p.name for p in out.iterdir())}"
    m = json.loads(manifest.read_text())
    missing = [f for f in m["files"] if not (out / f).is_file()]
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    if missing or size != m["size_bytes"]:
        return f"incomplete: missing {missing}, {size} bytes of {m['size_bytes']}"
    r = subprocess.run([QUANT, "inspect", str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`quant inspect` fails: {r.stderr.strip()}"
    return f"complete: {m['format']}"


def convert_cmd(src: Path, fmt: str, out: Path, *extra: str) -> list[str]:
    return [QUANT, "convert", str(src), "-f", fmt, "-o", str(out), "-q", *extra]


def run_and_kill(cmd: list[str], out: Path, delay: float) -> tuple[float, bool]:
    """Start `cmd`; SIGKILL it `delay` s after its hidden partial folder appears.  Returns (seconds
    the partial folder existed before the kill, whether the process had exited by itself first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not partial.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no partial folder within 120 s"
        time.sleep(0.005)
    seen = time.monotonic()
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.monotonic() - seen, proc.returncode == 0  # 0: it had finished; -9: killed


def conversion_window(src: Path, fmt: str, out: Path) -> float:
    """Seconds an uninterrupted conversion spends after creating its partial folder."""
    proc = subprocess.Popen(convert_cmd(src, fmt, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    while not partial.exists() and proc.poll() is None:
        time.sleep(0.005)
    seen = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return time.monotonic() - seen


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def dead_pid() -> int:
    """The PID of a process that has exited (as a killed conversion's is)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


FRACTIONS = [0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0] if FULL else [0.0, 0.3, 0.6, 0.9]


@pytest.mark.parametrize("fmt, replacement", [("gguf-q4_k_m", "gguf-f16")]
                         + ([("bnb-nf4", "gguf-q8_0")] if FULL else []))
def test_killed_conversions_never_leave_a_valid_looking_partial_output(fmt, replacement, default_model, tmp_path,
                                                                       figures):
    window = conversion_window(default_model, fmt, tmp_path / "timing" / "out")
    root = tmp_path / "fresh"
    root.mkdir()
    out = root / "out"
    states = []
    # 1. a fresh target, killed at points spread over the conversion
    for f in FRACTIONS:
        lived, _ = run_and_kill(convert_cmd(default_model, fmt, out), out, f * window)
        state = output_state(out)
        states.append(state)
        # absent, or (killed after its final rename) whole: nothing in between
        assert state in ("absent", f"complete: {fmt}"), (f, lived, state)
        if state != "absent":
            shutil.rmtree(out)
    # 2. a rerun over the killed runs' debris succeeds and removes it
    r = subprocess.run(convert_cmd(default_model, fmt, out), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert output_state(out) == f"complete: {fmt}" and leftovers(root) == ["out"]
    # 3. `--force` over that output, killed anywhere: a whole output (old or new) is always there
    forced = []
    for f in FRACTIONS:
        run_and_kill(convert_cmd(default_model, replacement, out, "--force"), out, f * window)
        forced.append(output_state(out))
        assert forced[-1] in (f"complete: {fmt}", f"complete: {replacement}"), (f, forced[-1])
    # 4. the one instant with no output at all: killed between moving the old output aside and
    #    renaming the new one in (what that leaves, made by hand); the next run puts the old one back
    old_format = forced[-1].split(": ")[1]
    aside = root / f".out.old-{dead_pid()}"
    out.rename(aside)
    (root / f".out.partial-{dead_pid()}").mkdir()  # and the new one, finished but not renamed
    assert output_state(out) == "absent"
    r = subprocess.run(convert_cmd(default_model, replacement, out), capture_output=True, text=True)
    assert r.returncode == 1 and "already exists" in r.stderr, r.stderr
    assert output_state(out) == f"complete: {old_format}" and leftovers(root) == ["out"]
    kills = len(FRACTIONS) * 2
    figures.add(f"convert {fmt}: SIGKILL points (fresh target)",
                f"{len(FRACTIONS)} at {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the {window:.2f} s after "
                f"the partial folder appears; outputs after the kill: "
                f"{states.count('absent')} absent, {len(states) - states.count('absent')} complete, 0 invalid")
    figures.add(f"convert {fmt} --force {replacement} over a finished output: SIGKILL points",
                f"{len(FRACTIONS)}; a whole output every time ({forced.count(f'complete: {fmt}')} old, "
                f"{forced.count(f'complete: {replacement}')} new), 0 missing or invalid")
    figures.add(f"convert {fmt}: killed between the two renames of a --force replacement",
                "previous output restored by the next run; 0 bytes lost")
    figures.add(f"convert {fmt}: rerun after {kills} kills", "complete output, no leftover partial folders")


# ---- b. training killed ------------------------------------------------------------------------------

def test_training_killed_while_saving_a_checkpoint_resumes(default_model, tmp_path, figures):
    from quantserve.demo.corpus import task_examples, write_jsonl

    data = tmp_path / "task.jsonl"
    write_jsonl(data, task_examples(256, "train"))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "quantserve", "train", "--quiet", "--data", str(data), "--max-steps", "12",
           "--micro-batch", "8", "--save-steps", "4", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    saving = out / "checkpoint-8"
    deadline = time.monotonic() + 300
    while not saving.is_dir():  # kill the moment the Trainer starts writing checkpoint-8
        assert proc.poll() is None, "training ended before checkpoint-8 was written"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    state = saving / "trainer_state.json"
    mid_save = not state.exists()
    if not mid_save:  # the kill came a moment late; a moment earlier the Trainer had not written this yet
        state.unlink()
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    assert not (out / "train_log.json").exists(), "the run finished before the kill"

    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["resumed_from"].endswith("checkpoint-4") and log["global_step"] == 12
    assert len([s for s in log["steps"] if "loss" in s]) == 12  # the log covers the whole run
    assert (out / "checkpoint-12" / "trainer_state.json").is_file()
    figures.add("training SIGKILLed while writing checkpoint-8",
                f"killed {'mid-save' if mid_save else 'just after the save (trainer_state.json removed)'}; "
                "the rerun skipped the incomplete checkpoint, resumed from checkpoint-4, reached step 12")
    figures.add("training SIGKILLed between checkpoints",
                "tests/train/test_train_runs.py::test_sigkill_then_resume_matches_an_uninterrupted_run "
                "(slow; resumes, final loss within 2 % of an uninterrupted run)")


# ---- c, d. out of memory and failing decode steps ----------------------------------------------------

def _stream_lines(url: str, body: dict) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=120)
    return client, client.send(client.build_request("POST", url, json=body), stream=True)


def _events(lines: list[str]) -> list[dict | str]:
    """The SSE data of a stream, parsed; "[DONE]" stays a string."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


# Address space the server may use beyond what it holds after warm-up.  A normal request needs a
# few MiB; 32 choices of a 470-token prompt hold 32 x 470 x 4 KiB = 59 MiB of KV cache, and the
# decode step that pads them into one batch as much again.  Measured: 32 to 64 MiB all behave the same.
OOM_MARGIN_MIB = 48
# 2 prompts x n=16 = 32 sequences of 471 tokens.  Prompts enter about one per step (chunked prefill),
# so each decodes 40 tokens (no early EOS) to overlap with the others and hit the limit together.
BIG = {"prompt": [[1] + [7] * 470] * 2, "n": 16, "max_tokens": 40, "ignore_eos": True}


def test_out_of_memory_is_a_503_and_the_others_keep_going(default_model, figures):
    srv = ServerProcess(default_model, "--max-batch", "32", "--max-queue", "64", name="tiny")
    try:
        url = srv.base_url + "/v1/completions"
        warm = httpx.post(url, json={"model": "tiny", "prompt": [[1] + [5] * 100] * 2, "n": 4, "max_tokens": 8},
                          timeout=120)
        assert warm.status_code == 200
        proc = psutil.Process(srv.proc.pid)
        vms = proc.memory_info().vms
        resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (vms + OOM_MARGIN_MIB * 2**20, resource.RLIM_INFINITY))
        try:
            # a small stream is running when the big request arrives
            client, small = _stream_lines(url, {"model": "tiny", "prompt": "Repeat: a b c", "max_tokens": 150,
                                                "ignore_eos": True, "temperature": 0, "stream": True,
                                                "stream_options": {"include_usage": True}})
            lines = small.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            # non-streaming: the OpenAI-style 503
            big = httpx.post(url, json={"model": "tiny", **BIG}, timeout=120)
            assert big.status_code == 503, big.text
            assert big.json()["error"]["code"] == "out_of_memory"
            assert big.json()["error"]["type"] == "service_unavailable"
            # streaming: an error event, then [DONE]
            big_client, big_stream = _stream_lines(url, {"model": "tiny", **BIG, "stream": True})
            assert big_stream.status_code == 200
            big_events = _events(list(big_stream.iter_lines()))
            big_client.close()
            errors = [e for e in big_events if isinstance(e, dict) and "error" in e]
            assert errors and errors[0]["error"]["code"] == "out_of_memory" and big_events[-1] == "[DONE]"
            # the small stream went on undisturbed, to its last token
            small_events = _events([first, *lines])
            client.close()
            assert small_events[-1] == "[DONE]" and not any("error" in e for e in small_events[:-1])
            assert small_events[-2]["usage"]["completion_tokens"] == 150
            assert small_events[-3]["choices"][0]["finish_reason"] == "length"
            # and new requests are served, under the same limit
            after = srv.client().completions.create(model="tiny", prompt="What is 1 + 1?", max_tokens=8)
            assert after.choices[0].finish_reason in ("stop", "length")
            m = srv.wait_idle()
            log = srv.log_path.read_text()
        finally:
            resource.prlimit(srv.proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert m["quantserve:kv_cache_used_tokens"] == 0 and m["quantserve:num_requests_running"] == 0
        counted = outcomes(srv)
        assert counted["error"] == 2 and srv.proc.poll() is None
    finally:
        assert srv.stop() == 0, srv.log()
    shed = log.count("shedding request")
    figures.add("out of memory (RLIMIT_AS = post-warm-up VM size + 48 MiB, 32 x 471-token sequences)",
                f"2 requests (plain, streaming) got 503 out_of_memory; {shed} sequences shed, "
                f"{len(errors)} error events in the stream")
    figures.add("out of memory: the others", "a 150-token stream running alongside finished all 150 tokens; "
                "a new request afterwards succeeded; KV cache and batch back to 0; server alive")


def test_a_failing_decode_step_is_an_error_reply_not_a_short_completion(default_model, monkeypatch, figures):
    # decode steps 3, 8 and 13 fail (server/scheduler.py: _FaultyDecode says why this one is injected)
    monkeypatch.setenv("QUANTSERVE_FAULT_DECODE_STEPS", "3,8,13")
    srv = ServerProcess(default_model, "--max-batch", "4", name="tiny")
    try:
        client = srv.client()
        body = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        chat = dict(model="tiny", messages=[{"role": "user", "content": "Count from 1 to 9."}], max_tokens=10,
                    temperature=0, stream=True)
        # decode steps 1-3: the third fails after 3 tokens
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(prompt="Repeat: a b c", **body)
        assert e.value.status_code == 500 and e.value.body["code"] == "engine_error"
        assert "decode step 3 failed" in e.value.body["message"]
        # steps 4-8: a stream gets its first tokens, then an error event instead of a finish_reason
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60,
                          json={**chat, "ignore_eos": True}) as r:
            events = _events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        assert sum(1 for e in events[:-2] if e["choices"][0]["delta"].get("content")) >= 1
        assert not any(e["choices"][0].get("finish_reason") for e in events[:-2])
        # steps 9-13: the official client raises on that event rather than returning a short text
        with pytest.raises(openai.APIError) as e:
            collect_stream(client.chat.completions.create(**chat, extra_body={"ignore_eos": True}))
        assert e.value.body["code"] == "engine_error"
        # steps 14 on: served as usual
        ok = client.completions.create(prompt="Repeat: a b c", **body)
        assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 10
        srv.wait_idle()
        counted = outcomes(srv)
        assert counted["error"] == 3 and counted["success"] == 1
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add("decode step failed (injected at steps 3, 8, 13)",
                "non-streaming: 500 engine_error; streaming: tokens, then an error event, then [DONE] "
                "(no finish_reason), which the openai client raises as APIError; the next request succeeded")


# ---- e. the model file changed under a running server ------------------------------------------------

PROMPTS = ["Repeat: k q m", "What is 12 + 30?", "Sort: d a c b"]


def _greedy(srv: ServerProcess) -> list[str]:
    client = srv.client()
    return [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]


@pytest.mark.parametrize("engine", ["hf", "gguf"])
def test_model_file_changed_under_a_running_server(engine, default_model, tmp_path, figures):
    if engine == "hf":
        served = shutil.copytree(default_model, tmp_path / "model")
        weights = served / "model.safetensors"
    else:
        from quantserve.quant.convert import convert

        served = convert(default_model, "gguf-q8_0", tmp_path / "model", progress=False) / "model.gguf"
        weights = served
    srv = ServerProcess(served, "--max-batch", "4", name="tiny")
    survived = []
    try:
        expected = _greedy(srv)
        size = weights.stat().st_size

        def overwrite_in_place():  # as `cp other.file model` does: same inode, new bytes
            with open(weights, "r+b") as f:
                f.write(os.urandom(size))

        def truncate_in_place():
            os.truncate(weights, 0)

        def delete():
            weights.unlink()

        def replace_by_rename():  # as `quant convert --force` does: a new inode under the old name
            fresh = weights.with_name(weights.name + ".new")
            fresh.write_bytes(os.urandom(size))
            fresh.rename(weights)

        for fault in (overwrite_in_place, truncate_in_place, delete, replace_by_rename):
            fault()
            assert _greedy(srv) == expected, fault.__name__
            assert srv.proc.poll() is None and httpx.get(srv.base_url + "/health").status_code == 200
            survived.append(fault.__name__)
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add(f"{engine} engine: weights file {', '.join(survived)} while serving",
                f"{len(survived)} of 4 survived; greedy outputs unchanged (weights read into memory at load, "
                "no mmap of the file)")


# ---- f. clients killed mid-stream --------------------------------------------------------------------

CLIENT = """
import sys, httpx
with httpx.stream("POST", sys.argv[1], timeout=60, json={"model": "tiny", "prompt": "Repeat: a b c",
        "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
    for line in r.iter_lines():
        if line.startswith("data: "):
            print("streaming", flush=True)
            sys.stdin.read()  # hold the stream open until killed
"""


def test_clients_killed_mid_stream_leak_no_slot(default_model, figures):
    kills = 40 if FULL else 10
    srv = ServerProcess(default_model, "--max-batch", "2", "--max-queue", "2", name="tiny")
    try:
        before = srv.metrics()
        for _ in range(kills):
            client = subprocess.Popen([sys.executable, "-c", CLIENT, srv.base_url + "/v1/completions"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert client.stdout.readline().strip() == "streaming"
            client.kill()
            client.wait()
        m = srv.wait_idle()
        assert (m["quantserve:num_requests_running"], m["quantserve:kv_cache_used_tokens"]) == (0, 0)
        cancelled = (m["quantserve:engine_cancelled_requests_total"]
                     - before["quantserve:engine_cancelled_requests_total"])
        assert cancelled == kills
        # every slot is free again: requests are served as usual
        client = srv.client()
        for _ in range(4):
            r = client.completions.create(model="tiny", prompt="hi", max_tokens=4)
            assert r.choices[0].finish_reason in ("stop", "length")
        assert outcomes(srv)["disconnected"] == kills
    finally:
        assert srv.stop() == 0, srv.log()
    figures.add("client processes SIGKILLed mid-stream (max-batch 2)",
                f"{kills} kills; {cancelled:.0f} generations cancelled, 0 slots or KV tokens leaked")
    figures.add("client disconnects in the soak", "see runs/reliability/soak.json (mid-stream, after headers, "
                "before any reply; slots and KV cache back to 0)")
