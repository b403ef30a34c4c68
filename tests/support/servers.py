"""Helpers for the server tests (no tests here): a real `quantserve serve` process on 127.0.0.1,
and the offline references the served output is compared with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from quantserve.settings import free_port
from tests.support import REPO
PROMPTS = ["Sort: d a c b", "What is 12 + 30?", "Repeat: k q m", "What comes after g?",
           "How many letters in: a b c", "What is the capital of Keltria?"]


def unlabelled_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of a /metrics page, name -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class ServerProcess:
    """`python -m quantserve serve ...` in its own process; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, model: Path | str, *args: str, api_key: str | None = None, name: str | None = None,
                 start_timeout: float | None = None, threads: int = 1):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model_name = name
        self.api_key = api_key
        self.saw_loading = False
        cmd = [sys.executable, "-m", "quantserve", "serve", str(model), "--port", str(self.port),
               "--log-level", "warning", *args]
        if name:
            cmd += ["--served-model-name", name]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        env.pop("QUANTSERVE_API_KEY", None)
        if api_key:  # through the environment, so the key never shows in a process listing
            env["QUANTSERVE_API_KEY"] = api_key
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"quantserve-test-{self.port}.log"
        self._log = open(self.log_path, "w")
        # QUANTSERVE_TEST_CWD: where the GPU scripts run servers from (in the source tree `python -m
        # quantserve` would import its bare folder instead of the package installed there)
        self.proc = subprocess.Popen(cmd, cwd=os.environ.get("QUANTSERVE_TEST_CWD", REPO), env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        try:
            # a GPU's fast engine compiles its graphs before it is ready: the GPU scripts allow more
            self._wait_ready(start_timeout or float(os.environ.get("QUANTSERVE_TEST_START_TIMEOUT", 90)))
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base_url + "/health", timeout=2)
                if r.status_code == 503 and r.json()["error"]["code"] == "model_loading":
                    self.saw_loading = True  # the socket is open before the model is ready
                if r.status_code == 200:
                    self.health = r.json()
                    self.model_name = self.model_name or self.health["model"]
                    return
            except httpx.HTTPError:
                pass
            # often: the checkpoint's checks run before the port opens, so a tiny model's load
            # after it (the window test_server_ops looks for) takes well under a second
            time.sleep(0.02)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else "(log removed after a clean exit)"

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        if self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)  # keep the log only when something went wrong
        return self.proc.returncode

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=kw.pop("api_key", self.api_key or "unused"),
                      max_retries=0, timeout=kw.pop("timeout", 60), **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                           timeout=kw.pop("timeout", 120), **kw)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once nothing runs, waits or holds KV cache (or the last reading at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = all(m.get(f"quantserve:{k}", 0) == 0
                       for k in ("num_requests_running", "num_requests_waiting", "kv_cache_used_tokens"))
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def decode_steps_and_rows(self, before: dict[str, float]) -> tuple[float, float]:
        """Decode steps run and rows they advanced since the `before` reading, once idle; rows /
        steps is the mean decode batch."""
        after = self.wait_idle()
        return tuple(after[f"quantserve:engine_decode_{k}_total"] - before[f"quantserve:engine_decode_{k}_total"]
                     for k in ("steps", "rows"))

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, name -> value."""
        return unlabelled_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)


def engine_server(engine: str, default_model, tmp_path_factory, *args: str) -> ServerProcess:
    """A server of the default model on `engine` (hf, fast, or gguf on its Q8_0 conversion), named
    "default", batching up to 8."""
    model = default_model
    if engine == "gguf":
        from quantserve.quant.convert import convert

        model = convert(default_model, "gguf-q8_0", tmp_path_factory.mktemp("gguf") / "q8", progress=False)
    return ServerProcess(model, "--engine", engine, "--max-batch", "8", *args, name="default")


def collect_stream(stream) -> tuple[list[str], list[str | None], object]:
    """(text per choice, finish_reason per choice, usage) from a chat or completions stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    n = max(texts) + 1 if texts else 0
    return [texts[i] for i in range(n)], [finish[i] for i in range(n)], usage


MAX_TOKENS = 24


def hf_reference(folder):
    """Offline greedy generation with transformers' own `generate`, one prompt at a time."""
    import torch

    from quantserve.modeling import chat_prompt, load_model, load_tokenizer

    torch.set_num_threads(1)  # the machine is shared: spinning OpenMP threads slow a tiny model ~30x
    tok, model = load_tokenizer(folder), load_model(folder)

    class Ref:
        tokenizer = tok

        @staticmethod
        def chat_ids(user: str) -> list[int]:
            return tok(chat_prompt(tok, user), add_special_tokens=False).input_ids

        @staticmethod
        def greedy(prompt_ids: list[int], max_new: int = MAX_TOKENS) -> list[int]:
            ids = torch.tensor([prompt_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            return out[0, len(prompt_ids):].tolist()

        @staticmethod
        def greedy_ignoring_eos(prompt_ids: list[int], max_new: int) -> list[int]:
            """Greedy decoding that runs past eos, as the server's `ignore_eos` does."""
            ids, out = list(prompt_ids), []
            with torch.no_grad():
                for _ in range(max_new):
                    token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                    ids.append(token)
                    out.append(token)
            return out

        @staticmethod
        def text(ids: list[int]) -> str:
            return tok.decode(ids, skip_special_tokens=True)

        @staticmethod
        def logprobs(prompt_ids: list[int], new_ids: list[int]):
            """Teacher-forced log-softmax rows for each generated position."""
            with torch.no_grad():
                logits = model(torch.tensor([prompt_ids + new_ids])).logits[0]
            return torch.log_softmax(logits[len(prompt_ids) - 1: -1].float(), dim=-1)

    return Ref


def replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ServeReplica:quantserve-[0-9a-f]+:model"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]
