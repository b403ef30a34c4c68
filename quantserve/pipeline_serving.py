"""The pipeline's serving stages: a format served by `quantserve serve` in a child process and scored
through the real HTTP API with the official `openai` client (the task's held-out prompts, and the
tool skill's with the corpus's calculator tool), and the last stage of `make run`, which serves the
chosen format until Ctrl-C with ready-to-paste requests.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from quantserve.settings import UserError, free_port

if TYPE_CHECKING:
    from quantserve.pipeline import PipelineConfig

TOOL_MAX_TOKENS = 64  # a call of the default corpus's tool is ~31 tokens

# A SIGTERM to the pipeline (kill, timeout, a supervisor) reaches it alone, not its servers, and
# Python's default is to exit on the spot: the server of the last stage was left running, holding
# the port (and a GPU).  `stop_on_sigterm` makes it end the way Ctrl-C does, servers stopped first.
_terminated = False


def drain(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for a server told to stop; killed past `timeout`, or at once on a second Ctrl-C or
    SIGTERM meanwhile (never left running)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except BaseException:  # another interrupt: the server goes now, and so does this command
        proc.kill()
        proc.wait()
        raise


def stop_on_sigterm() -> None:
    import signal

    def on_sigterm(signum, frame):
        global _terminated
        _terminated = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


class ServerProcess:
    """`quantserve serve` in a child process, stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, model: Path, port: int, log: Path, gpu_profile: str | None, host: str = "127.0.0.1",
                 extra: list[str] | None = None):
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "quantserve", "serve", str(model), "--host", host, "--port", str(port),
               "--log-level", "warning", *(extra or [])]
        if gpu_profile:
            cmd += ["--gpu-profile", gpu_profile]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise UserError(f"server exited early: {tail[0]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise UserError(f"server not ready after {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            drain(self.proc, 30)
        self._log_file.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_and_score(model: Path, heldout, tool_heldout, cfg: "PipelineConfig") -> dict:
    """Serve `model` in a child server and ask it the held-out task and tool prompts through the
    official client: accuracy, tokens/s and a few samples of each."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    port = free_port(cfg.host)
    with ServerProcess(model, port, Path(cfg.out) / "serve" / f"{model.name}.log", cfg.gpu_profile) as server:
        server.wait_ready()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        name = client.models.list().data[0].id

        def ask(prompt: str):
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=cfg.max_tokens)
            return r.choices[0].message.content or "", r.usage.completion_tokens

        t0 = time.time()
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            answers = list(pool.map(ask, [e.prompt for e in heldout]))
            wall = time.time() - t0
            calls = list(pool.map(lambda e: tool_call(client, name, e), tool_heldout))
    from quantserve.demo.corpus import exact_match

    accuracy = exact_match([a for a, _ in answers], [e.answer for e in heldout])
    tool_accuracy = sum(ok for ok, _ in calls) / len(calls) if calls else None
    tokens = sum(n for _, n in answers)
    return {"accuracy": accuracy, "tokens_per_s": round(tokens / wall, 1), "tokens": tokens,
            "seconds": round(wall, 2), "samples": [[e.prompt, a] for e, (a, _) in zip(heldout[:5], answers)],
            "tool_accuracy": tool_accuracy, "tool_samples": [[e.prompt, c] for e, (_, c) in zip(tool_heldout[:5], calls)]}


def tool_call(client, model_name: str, example) -> tuple[bool, dict]:
    """Ask a tool skill's held-out question with the calculator tool, `tool_choice` "auto"; right
    when the reply is one call of the expected function with the expected arguments (read by the
    server's own tool-call parser).  (right, what came back)."""
    from quantserve.demo import tool_skill

    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": example.prompt}], tools=[tool_skill.ADD_TOOL],
        tool_choice="auto", temperature=0, max_tokens=TOOL_MAX_TOKENS)
    choice = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    got = {"finish_reason": choice.finish_reason, "calls": calls, "content": choice.message.content}
    if choice.finish_reason != "tool_calls" or len(calls) != 1:
        return False, got
    name, arguments = calls[0]
    try:
        arguments = json.loads(arguments)
    except json.JSONDecodeError:
        return False, got
    return (name, arguments) == tool_skill.expected_call(example.answer), got


def ready_requests(url: str, model_name: str, prompt: str) -> tuple[str, str]:
    """A curl and a Python one-liner (shell-quoted, greedy) that ask `prompt` of the served model.

    The Python line names this virtualenv's interpreter, which has `openai`, so it works pasted
    into any shell."""
    body = json.dumps({"model": model_name, "temperature": 0, "messages": [{"role": "user", "content": prompt}]})
    curl = f"curl -s {url}/chat/completions -H 'Content-Type: application/json' -d {shlex.quote(body)}"
    q = json.dumps  # a JSON string is a Python string literal too, in double quotes
    python = (f"from openai import OpenAI; c = OpenAI(base_url={q(url)}, api_key=\"none\"); "
              f"print(c.chat.completions.create(model={q(model_name)}, temperature=0, messages=[{{\"role\": \"user\", "
              f"\"content\": {q(prompt)}}}]).choices[0].message.content)")
    return curl, f"{shlex.quote(sys.executable)} -c {shlex.quote(python)}"


def serve_forever(model: Path, cfg: "PipelineConfig", example) -> None:
    """The last stage of `make run`: serve the chosen format until Ctrl-C, with ready-to-paste
    requests that ask a held-out task prompt (`example`)."""
    url = f"http://{cfg.host}:{cfg.port}/v1"
    curl, python = ready_requests(url, model.name, example.prompt)
    print(f"\nserving {model} at {url}  (Ctrl-C stops)\n", flush=True)
    print(f"  {curl}\n  {python}\n  (expected answer: {example.answer!r})\n", flush=True)
    cmd = [sys.executable, "-m", "quantserve", "serve", str(model), "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.gpu_profile:
        cmd += ["--gpu-profile", cfg.gpu_profile]
    proc = subprocess.Popen(cmd)
    try:
        returncode = proc.wait()
    except KeyboardInterrupt:
        if _terminated:  # Ctrl-C in a terminal reached the server too; a SIGTERM did not
            proc.send_signal(2)
        drain(proc, 60)  # its requests drained, as `quantserve serve` does on Ctrl-C
        print("stopped")
        return
    if returncode not in (0, 130, -2):
        raise UserError(f"server exited with status {returncode}")
