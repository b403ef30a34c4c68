"""Pick and build the engine for a model path: a GGUF file (or a folder holding one) -> `gguf`,
a Hugging Face folder (including bitsandbytes outputs) -> `hf`.  Both are a `ScheduledEngine`:
the shared continuous-batching scheduler over that engine's `DecodeBackend`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from quantserve.server.engine import EngineInfo, EngineRequest, EngineStats, TokenStream
from quantserve.server.exceptions import ModelLoadError
from quantserve.server.faults import with_faults

log = logging.getLogger("quantserve.server")


@dataclass
class EngineOptions:
    context: int | None = None  # default: the model's trained context
    max_batch: int = 32
    max_queue: int = 64
    gpu_profile: str | None = None
    engine: str = "auto"  # auto (by the path), hf, fast (server/fastcore) or gguf
    weight_quant: str = "none"  # fast engine only: none, int8 or int4 weight-only
    threads: int | None = None  # CPU threads for the model; default: torch's own / half the cores for llama.cpp
    trust_pickle: bool = False  # serve a checkpoint whose weights are only pickles (rewritten as safetensors)
    prefill_chunk: int = 512  # prompt tokens prefilled between two decode steps (chunked prefill)


def detect_model_kind(path: Path, trust_pickle: bool = False) -> tuple[str, Path]:
    """('gguf' | 'hf', the file or folder to load), or a ModelLoadError saying what is wrong."""
    from quantserve.modeling import PICKLE_WEIGHTS, require_safetensors

    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        if any(path.match(pattern) for pattern in PICKLE_WEIGHTS):
            raise ModelLoadError(f"{path}: a pickle weight file; serve a .gguf file or a Hugging Face checkpoint "
                            "folder (safetensors; pickle weights only with --trust-pickle)")
        raise ModelLoadError(f"{path}: not a model (serve a .gguf file or a Hugging Face checkpoint folder)")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1 and not (path / "config.json").is_file():
        return "gguf", ggufs[0]
    if len(ggufs) > 1 and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: holds {len(ggufs)} .gguf files; name the one to serve")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face checkpoint (no config.json) and no .gguf file")
    require_safetensors(path, trust_pickle, flag="--trust-pickle")
    return "hf", path


def _warm_up(backend) -> None:
    """One tiny prefill + decode before /health says ready: the first call of a backend allocates
    its buffers (llama.cpp: seconds), which should not land on the first user's request."""
    logits = backend.prefill(0, [0])
    backend.decode([0], [int(logits.argmax())])
    backend.free(0)


class ScheduledEngine:
    """An `Engine`: a backend loaded at start-up, driven by the shared scheduler thread."""

    def __init__(self, path: Path, options: EngineOptions):
        self.kind, self.path = detect_model_kind(path, options.trust_pickle)
        self.options = options
        if options.engine not in ("auto", self.kind) and not (options.engine == "fast" and self.kind == "hf"):
            raise ModelLoadError(f"cannot serve {path}: it is a {self.kind} model", "engine", options.engine)
        if options.engine == "fast":
            self.kind = "fast"
        if options.weight_quant != "none" and self.kind != "fast":
            raise ModelLoadError("applies to the fast engine only", "weight_quant", options.weight_quant)
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self._scheduler = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._converted = None  # temporary safetensors copy of a trusted pickle checkpoint

    def _safetensors_path(self) -> Path:
        """The folder to load: itself, or (trusted pickle weights only) a safetensors copy of it,
        so the engines' loaders stay safetensors-only."""
        if self.kind == "gguf" or any(self.path.glob("*.safetensors")):
            return self.path
        import tempfile

        from quantserve.modeling import safetensors_copy

        self._converted = tempfile.TemporaryDirectory(prefix="quantserve-trusted-")
        log.warning("%s: loading trusted pickle weights (--trust-pickle) via a safetensors copy", self.path)
        return safetensors_copy(self.path, Path(self._converted.name) / self.path.name)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        from quantserve.server.scheduler import Scheduler

        o = self.options
        self.path = self._safetensors_path()
        if self.kind == "hf":
            from quantserve.server.backend import HFBackend
            from quantserve.server.hf_engine import load_hf

            if o.threads:
                import torch

                torch.set_num_threads(o.threads)
            model, self.tokenizer, info = load_hf(self.path, o.gpu_profile, o.context, o.max_batch, o.max_queue)
            backend = HFBackend(model, o.max_batch, info.context_length)
        elif self.kind == "fast":
            from quantserve.server.hf_engine import load_fast

            if o.threads:
                import torch

                torch.set_num_threads(o.threads)
            backend, self.tokenizer, info = load_fast(self.path, o.gpu_profile, o.context, o.max_batch,
                                                      o.max_queue, o.weight_quant, o.prefill_chunk)
        else:
            from quantserve.server.gguf_engine import load_gguf

            backend, self.tokenizer, info = load_gguf(self.path, o.context, o.max_batch, o.max_queue, o.threads)
        _warm_up(backend)
        backend = with_faults(backend)  # the reliability tests' injected failures; unset: a no-op
        self._loop = loop
        self._scheduler = Scheduler(backend, self.tokenizer.eos_token_ids, o.max_batch, o.max_queue,
                                    log=log.error, prefill_chunk=o.prefill_chunk)
        self.info = info  # set last: is_ready() turns true only when everything is in place
        log.info("loaded %s engine: %s (%s, attention %s, context %d, batch %d)", info.engine,
                 info.model_path, info.dtype, info.attention, info.context_length, info.max_batch)

    def is_ready(self) -> bool:
        return self.info is not None

    def submit(self, request: EngineRequest) -> TokenStream:
        stream = TokenStream(request, self._loop, self)
        self._scheduler.submit(stream)
        return stream

    def cancel(self, request_id: int) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel(request_id)

    def stats(self) -> EngineStats:
        if self._scheduler is None:
            return EngineStats(0, 0, 0, 0)
        return self._scheduler.stats()

    def shutdown(self, grace_s: float) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(grace_s)
        if self._converted is not None:
            self._converted.cleanup()
