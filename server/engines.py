"""Pick and build the engine for a model path: a GGUF file (or a folder holding one) -> `gguf`,
a Hugging Face folder (including bitsandbytes outputs) -> `hf`.  Both are a `ScheduledEngine`:
the shared continuous-batching scheduler over that engine's `DecodeBackend`."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from server.engine import EngineInfo, EngineRequest, EngineStats, TokenStream
from quantserve.settings import UserError

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


def resolve_model(path: Path, trust_pickle: bool = False) -> tuple[str, Path]:
    """('gguf' | 'hf', the file or folder to load), or a UserError saying what is wrong."""
    from quantserve.modeling import PICKLE_WEIGHTS, require_safetensors

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        if any(path.match(pattern) for pattern in PICKLE_WEIGHTS):
            raise UserError(f"{path}: a pickle weight file; serve a .gguf file or a Hugging Face checkpoint "
                            "folder (safetensors; pickle weights only with --trust-pickle)")
        raise UserError(f"{path}: not a model (serve a .gguf file or a Hugging Face checkpoint folder)")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1 and not (path / "config.json").is_file():
        return "gguf", ggufs[0]
    if len(ggufs) > 1 and not (path / "config.json").is_file():
        raise UserError(f"{path}: holds {len(ggufs)} .gguf files; name the one to serve")
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face checkpoint (no config.json) and no .gguf file")
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
        self.kind, self.path = resolve_model(path, options.trust_pickle)
        self.options = options
        if options.engine not in ("auto", self.kind) and not (options.engine == "fast" and self.kind == "hf"):
            raise UserError(f"{path} is a {self.kind} model: --engine {options.engine} cannot serve it")
        if options.engine == "fast":
            self.kind = "fast"
        if options.weight_quant != "none" and self.kind != "fast":
            raise UserError("--weight-quant applies to --engine fast only")
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
        from server.scheduler import Scheduler

        o = self.options
        self.path = self._safetensors_path()
        if self.kind == "hf":
            from server.backend import HFBackend
            from server.hf_engine import load_hf

            if o.threads:
                import torch

                torch.set_num_threads(o.threads)
            model, self.tokenizer, info = load_hf(self.path, o.gpu_profile, o.context, o.max_batch, o.max_queue)
            backend = HFBackend(model, o.max_batch, info.context_length)
        elif self.kind == "fast":
            from server.hf_engine import load_fast

            if o.threads:
                import torch

                torch.set_num_threads(o.threads)
            backend, self.tokenizer, info = load_fast(self.path, o.gpu_profile, o.context, o.max_batch,
                                                      o.max_queue, o.weight_quant, o.prefill_chunk)
        else:
            from server.gguf_engine import load_gguf

            backend, self.tokenizer, info = load_gguf(self.path, o.context, o.max_batch, o.max_queue, o.threads)
        _warm_up(backend)
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
