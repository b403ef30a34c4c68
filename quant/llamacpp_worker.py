"""llama.cpp in a process of its own, for `quant eval` (logits) and k-quant conversion.

Why a separate process: llama-cpp-python's CUDA build was seen to segfault loading a model into a
process where torch had already created a CUDA context, while a fresh process ran it fine
(bench/RESULTS.md) — and a pipeline that has trained on the GPU holds one.  A native crash in the
worker also becomes one clear error instead of killing the caller.  The worker imports numpy and
llama_cpp only, never torch.

    python -m quantserve.quant.llamacpp_worker logits FILE.gguf N_CTX
        stdin: one JSON list of token ids per line; stdout, per line: rows and cols as two
        little-endian int32, then rows x cols float32 logits (one row per input position)
    python -m quantserve.quant.llamacpp_worker quantize SRC.gguf DST.gguf KIND
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from quantserve.settings import UserError

_HEADER = struct.Struct("<ii")


def _failure(proc: subprocess.Popen | subprocess.CompletedProcess, stderr_text: str, what: str) -> UserError:
    """The worker's own one-line error, or what killed it."""
    code = proc.returncode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return UserError(f"llama.cpp crashed ({name}) while {what}")
    lines = [line for line in stderr_text.strip().splitlines() if line.strip()]
    return UserError(lines[-1].removeprefix("error: ") if lines else f"llama.cpp worker failed ({code}) while {what}")


class LogitsWorker:
    """A worker process holding one GGUF model: `logits(ids)` is llamacpp.logits in that process."""

    def __init__(self, path: Path, n_ctx: int):
        self.path = Path(path)
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "quantserve.quant.llamacpp_worker", "logits", str(self.path),
                                      str(n_ctx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr)

    def logits(self, token_ids: list[int]):
        import numpy as np

        try:
            self.proc.stdin.write(json.dumps(list(token_ids)).encode() + b"\n")
            self.proc.stdin.flush()
            header = self.proc.stdout.read(_HEADER.size)
        except BrokenPipeError:
            header = b""
        if len(header) < _HEADER.size:
            raise self._died()
        rows, cols = _HEADER.unpack(header)
        data = self.proc.stdout.read(rows * cols * 4)
        if len(data) < rows * cols * 4:
            raise self._died()
        return np.frombuffer(data, dtype=np.float32).reshape(rows, cols)

    def _died(self) -> UserError:
        self.proc.wait()
        self._stderr.seek(0)
        return _failure(self.proc, self._stderr.read(), f"scoring {self.path}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> "LogitsWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quantize(src_gguf: Path, dst_gguf: Path, kind: str) -> None:
    """llamacpp.quantize, run in a worker process."""
    proc = subprocess.run([sys.executable, "-m", "quantserve.quant.llamacpp_worker", "quantize", str(src_gguf), str(dst_gguf),
                           kind], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise _failure(proc, proc.stderr, f"quantizing {src_gguf} to {kind.upper()}")


def _serve_logits(path: str, n_ctx: int) -> None:
    from quantserve.quant import llamacpp

    llm = llamacpp.load(Path(path), n_ctx=n_ctx)
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        rows = llamacpp.logits(llm, json.loads(line))
        out.write(_HEADER.pack(*rows.shape))
        out.write(rows.tobytes())
        out.flush()
    llm.close()


def main(argv: list[str]) -> int:
    from quantserve.quant import llamacpp

    try:
        if argv[:1] == ["logits"] and len(argv) == 3:
            _serve_logits(argv[1], int(argv[2]))
        elif argv[:1] == ["quantize"] and len(argv) == 4:
            llamacpp.quantize(Path(argv[1]), Path(argv[2]), argv[3])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
