"""Pick and build the engine for a model path: a GGUF file (or a folder holding one) -> `gguf`,
a Hugging Face folder (including bitsandbytes outputs) -> `hf`.  Both are a `ScheduledEngine`:
the shared continuous-batching scheduler over that engine's `DecodeBackend`."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path

from quantserve.server.config import EngineOptions  # noqa: F401  (its users import it from here too)
from quantserve.server.engine import EngineInfo, EngineRequest, EngineStats, TokenStream
from quantserve.server.exceptions import ModelLoadError
from quantserve.server.faults import with_faults

log = logging.getLogger("quantserve.server")


def detect_model_kind(path: Path, trust_pickle: bool = False) -> tuple[str, Path]:
    """('gguf' | 'hf', the file or folder to load), or a ModelLoadError saying what is wrong."""
    from quantserve.formats import NotAModel, identify
    from quantserve.modeling import weights_problem

    try:
        found = identify(path)
    except NotAModel as e:  # a bare pickle weight file included: no checkpoint, trusted or not
        raise ModelLoadError(str(e)) from None
    if found.container == "gguf":
        return "gguf", found.path
    problem = weights_problem(found.path, trust_pickle)
    if problem:
        text, trusting_helps = problem
        raise ModelLoadError(text, allowed_by="trust_pickle" if trusting_helps else None)
    return "hf", found.path


def auto_engine(path: Path) -> tuple[str, str]:
    """(engine, why) for a Hugging Face folder under `--engine auto`: the fast engine on a CUDA GPU
    for the architectures it runs (fp16/fp32 weights; bitsandbytes outputs stay on hf), else hf."""
    import json

    from quantserve.formats import identify
    from quantserve.quant.prequantized import quantization_problem

    fmt = identify(path).format
    if fmt.name in ("awq", "gptq"):  # transformers reads these only with AutoAWQ / GPTQModel installed
        problem = quantization_problem(path)  # a layout the fast engine cannot repack, by name
        if problem:
            raise ModelLoadError(problem)
        return "fast", f"a {fmt.name.upper()} checkpoint (the fast engine repacks its 4-bit weights)"
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return "hf", "no CUDA GPU (the fast engine's kernels and CUDA graphs need one)"
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    from quantserve.server.fastcore.model import FAST_MODEL_TYPES

    if model_type not in FAST_MODEL_TYPES:
        return "hf", f"the fast engine does not run {model_type!r} models ({', '.join(FAST_MODEL_TYPES)})"
    if fmt.name.startswith("bnb-"):
        return "hf", f"a bitsandbytes {fmt.name.removeprefix('bnb-')} checkpoint (the fast engine quantizes by itself)"
    if fmt.name != "hf":
        return "hf", "a checkpoint another transformers quantizer wrote (the fast engine takes fp16/fp32 weights)"
    return "fast", f"a {model_type} checkpoint on a CUDA GPU"


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _load_hf(path: Path, o: EngineOptions):
    from quantserve.server.backend import HFBackend
    from quantserve.server.hf_engine import load_hf

    _set_threads(o.threads)
    model, tokenizer, info = load_hf(path, o.gpu_profile, o.context, o.max_batch, o.max_queue)
    return HFBackend(model, o.max_batch, info.context_length, o.prefix_cache), tokenizer, info


def _load_fast(path: Path, o: EngineOptions):
    from quantserve.server.fastcore.loader import load_fast

    _set_threads(o.threads)
    return load_fast(path, o.gpu_profile, o.context, o.max_batch, o.max_queue, o.weight_quant, o.prefix_cache,
                     o.kv_cache_dtype, o.kv_blocks, o.batched_tokens())


def _load_gguf(path: Path, o: EngineOptions):
    from quantserve.server.gguf_engine import load_gguf

    return load_gguf(path, o.context, o.max_batch, o.max_queue, o.threads, o.prefix_cache, o.kv_cache_dtype)


# The engines, by kind: load(path, options) -> (DecodeBackend, ModelTokenizer, EngineInfo).  A new
# engine is one loader here; the scheduler, the API and the CLI's --engine choices follow.
ENGINES = {"hf": _load_hf, "fast": _load_fast, "gguf": _load_gguf}
ENGINE_CHOICES = ("auto", *ENGINES)


def _check_context(kind: str, path: Path, context: int | None) -> None:
    """--context against the model's trained context, from its config or GGUF metadata (no weights
    loaded; a GGUF file's tensor table checked whole on the way): raised at construction, so the
    CLI says it before it binds its port."""
    if kind == "gguf":
        from quantserve.server.gguf_engine import check_file

        check_file(path, context)
    else:  # hf and fast read the same checkpoint folders
        from quantserve.server.hf_engine import check_context

        check_context(path, context)


def _warm_up(backend) -> None:
    """One tiny prefill + decode before /health says ready: the first call of a backend allocates
    its buffers (llama.cpp: seconds), which should not land on the first user's request."""
    logits = backend.prefill(0, [0])
    backend.decode([0], [int(logits.argmax())])
    backend.free(0)
    backend.forget_prefixes()  # the warm-up's token is no prefix anyone asked for


def _freeze_start_up_objects() -> None:
    """Move everything alive after start-up (the model, the tokenizer, dynamo's and inductor's
    graphs: ~0.5 million objects) out of the garbage collector's reach, as vLLM and SGLang do after
    their warm-up.  Otherwise, once serving has made enough long-lived objects, a full collection
    walks them all with the GIL held, stalling the scheduler and the event loop together: in the
    default model's server on the CI CPU, 290 ms over 386,000 objects; 38 ms after the freeze)."""
    gc.collect()
    gc.freeze()


def _scheduler(backend, eos_token_ids: set[int], o: EngineOptions):
    """The paged scheduler (one forward per iteration, preemption) for a backend with a KV pool;
    the row scheduler (a prompt chunk, then a decode step) for the others."""
    if hasattr(backend, "pool"):
        from quantserve.server.paged_scheduler import PagedScheduler

        return PagedScheduler(backend, eos_token_ids, o.max_batch, o.max_queue, log=log.error,
                              max_batched_tokens=o.batched_tokens(), async_scheduling=o.async_scheduling)
    from quantserve.server.scheduler import Scheduler

    return Scheduler(backend, eos_token_ids, o.max_batch, o.max_queue, log=log.error, prefill_chunk=o.chunk())


class ScheduledEngine:
    """An `Engine`: a backend loaded at start-up, driven by the shared scheduler thread."""

    def __init__(self, path: Path, options: EngineOptions):
        from quantserve.capabilities import profile_problem

        self.kind, self.path = detect_model_kind(path, options.trust_pickle)
        problem = profile_problem(options.gpu_profile) if self.kind != "gguf" else None  # llama.cpp reads none
        if problem:  # before anything loads; the CLI has its flag's words
            raise ModelLoadError(problem)
        self.options = options
        if options.engine not in ("auto", self.kind) and not (options.engine == "fast" and self.kind == "hf"):
            raise ModelLoadError(f"cannot serve {path}: it is a {self.kind} model", "engine", options.engine)
        self.why = "asked for" if options.engine != "auto" else "by the path"
        if options.engine == "auto" and self.kind == "hf":
            self.kind, self.why = auto_engine(self.path)
        if options.engine == "fast":
            self.kind = "fast"
        if options.weight_quant != "none" and self.kind != "fast":
            raise ModelLoadError("applies to the fast engine only", "weight_quant", options.weight_quant)
        if options.kv_cache_dtype != "auto" and self.kind == "hf":
            raise ModelLoadError("applies to the fast and gguf engines only", "kv_cache_dtype", options.kv_cache_dtype)
        for name in ("max_num_batched_tokens", "kv_blocks"):  # the paged fast engine's own settings
            if getattr(options, name) is not None and self.kind != "fast":
                raise ModelLoadError("applies to the fast engine only", name, getattr(options, name))
        if not options.async_scheduling and self.kind != "fast":
            raise ModelLoadError("applies to the fast engine only (the others take no step ahead)",
                                 "async_scheduling", False)
        if self.kind == "fast" and options.batched_tokens() < options.max_batch:
            raise ModelLoadError(f"must hold a token for each of max_batch ({options.max_batch}) running sequences",
                                 "max_num_batched_tokens", options.batched_tokens())
        if options.prefill_chunk is not None and self.kind == "fast":
            raise ModelLoadError("applies to the hf and gguf engines (the fast engine's forward takes "
                                 "max_num_batched_tokens tokens, decodes and prompt chunks together)",
                                 "prefill_chunk", options.prefill_chunk)
        _check_context(self.kind, self.path, options.context)
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self.grammars = None  # structured.GrammarCompiler, once the tokenizer is loaded
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
        import time

        o = self.options
        t0 = time.perf_counter()
        self.path = self._safetensors_path()
        backend, self.tokenizer, info = ENGINES[self.kind](self.path, o)
        t1 = time.perf_counter()
        _warm_up(backend)
        backend = with_faults(backend)  # the reliability tests' injected failures; unset: a no-op
        self._loop = loop
        self._scheduler = _scheduler(backend, self.tokenizer.eos_token_ids, o)
        from quantserve.server.structured import GrammarCompiler

        vocab = backend.vocab_size
        self.grammars = GrammarCompiler(lambda: self.tokenizer.grammar_tokenizer(vocab))
        _freeze_start_up_objects()
        self.info = info  # set last: is_ready() turns true only when everything is in place
        info.extra["engine_choice"] = self.why
        info.extra["prefix_cache"] = o.prefix_cache
        if self.kind == "fast":
            info.extra["async_scheduling"] = o.async_scheduling
        info.extra["ready_s"] = round(time.perf_counter() - t0, 1)  # from the start of loading to ready
        start_up = info.extra.get("start_up_s")  # the fast engine says where its start-up went
        if start_up is not None:
            start_up["first request, scheduler"] = round(time.perf_counter() - t1, 2)
        parts = ", ".join(f"{what} {s:.1f} s" for what, s in (start_up or {}).items() if s >= 0.05)
        # what the numbers are computed in: the weights' format and the KV cache's, where not the dtype
        kv = info.extra.get("kv_cache_dtype")
        extras = (info.quantization if info.quantization != info.dtype else None,
                  f"{kv} KV cache" if kv and kv != info.dtype else None)
        numbers = ", ".join([info.dtype, *(x for x in extras if x)])
        log.info("loaded %s engine (%s): %s (%s, attention %s, context %d, batch %d) in %.1f s%s", info.engine,
                 self.why, info.model_path, numbers, info.attention, info.context_length, info.max_batch,
                 info.extra["ready_s"], f" ({parts})" if parts else "")

    def is_ready(self) -> bool:
        return self.info is not None

    def alive(self) -> bool:
        """False once the engine cannot serve any more (its scheduler thread has stopped)."""
        return self._scheduler is None or self._scheduler.alive()

    def submit(self, requests: list[EngineRequest]) -> list[TokenStream]:
        streams = [TokenStream(request, self._loop, self) for request in requests]
        self._scheduler.submit(streams)
        return streams

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
            gc.unfreeze()  # an engine started in a process that goes on (tests): its objects collectable again
        if self._converted is not None:
            self._converted.cleanup()
