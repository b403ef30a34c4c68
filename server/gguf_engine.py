"""The `gguf` engine's parts: llama.cpp (through llama-cpp-python's low-level API) as a
`DecodeBackend`, and the GGUF file's own tokenizer and chat template.

llama.cpp batches natively: one context holds `max_batch` sequences (`n_seq_max`, one KV stream
each, `kv_unified=False`), and a decode step is one `llama_decode` of a batch with one token per
sequence id.  So the shared scheduler gives GGUF models the same continuous batching, sampling and
logprobs as the `hf` engine; the layers go to the GPU when llama.cpp is built with CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantserve.server.engine import EngineInfo
from quantserve.server.exceptions import ModelLoadError, NoChatTemplateError
from quantserve.server.prefix_cache import RowBackend

_FILE_TYPES = {0: "F32", 1: "F16", 7: "Q8_0", 2: "Q4_0", 3: "Q4_1", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               12: "Q3_K_M", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K"}


class LlamaCppTokenizer:
    def __init__(self, model):
        self.model = model  # llama_cpp._internals.LlamaModel
        self.vocab_size = model.n_vocab()
        self.eos_token_ids = {t for t in (model.token_eos(), model.token_eot()) if t is not None and t >= 0}
        self._add_bos = model.add_bos_token()
        self._template = model.metadata().get("tokenizer.chat_template")
        self._bos = self.token_text(model.token_bos()) if model.token_bos() >= 0 else ""
        self._eos = self.token_text(model.token_eos()) if model.token_eos() >= 0 else ""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # special=True: control tokens written in the text are parsed, as Hugging Face tokenizers do
        return self.model.tokenize(text.encode(), add_bos=add_special_tokens and self._add_bos, special=True)

    def decode(self, ids: list[int]) -> str:
        return self.model.detokenize(ids, special=False).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return self.model.detokenize([token_id], special=True)

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def grammar_tokenizer(self, n_vocab: int):
        """The GGUF vocabulary as llguidance sees it (for structured output); torch-free."""
        import llguidance.llamacpp

        return llguidance.llamacpp.lltokenizer_from_vocab(self.model.vocab, n_vocab=max(n_vocab, self.vocab_size))

    @property
    def chat_template(self) -> str | None:
        return self._template

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        if not self._template:
            raise NoChatTemplateError("this GGUF file has no chat template (tokenizer.chat_template): use /v1/completions")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as transformers renders
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self._template).render(**template_kwargs, messages=messages, add_generation_prompt=True,
                                                      bos_token=self._bos, eos_token=self._eos)


class LlamaCppBackend(RowBackend):
    """Scheduler slots map to llama.cpp sequence ids (one KV stream each) through the shared prefix
    cache; a prefix from another sequence is llama.cpp's own cross-stream copy (`seq_cp`, which
    copies whole streams), cut to the prefix's length."""

    def __init__(self, model, max_batch: int, context_length: int, threads: int, prefix_cache: bool = True,
                 kv_int8: bool = False):
        import llama_cpp
        from llama_cpp import _internals

        self._llama_cpp = llama_cpp
        self.vocab_size = model.n_vocab()
        self._n_embd = model.n_embd()
        self.kv_capacity_tokens = max_batch * context_length
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_batch * context_length  # split evenly: each sequence gets context_length
        params.n_batch = max(context_length, max_batch)
        params.n_ubatch = min(512, params.n_batch)
        params.n_seq_max = max_batch
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        if kv_int8:  # llama-server's `-ctk q8_0 -ctv q8_0`: a quantized V cache needs flash attention
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_Q8_0
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=params.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._init_rows(max_batch, prefix_cache)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        self.ctx.kv_cache_seq_rm(dst, 0, -1)
        self.ctx.kv_cache_seq_cp(src, dst, -1, -1)  # applied by the next llama_decode
        self.ctx.kv_cache_seq_rm(dst, n, -1)

    def _truncate(self, row: int, n: int) -> None:
        self.ctx.kv_cache_seq_rm(row, n, -1)

    def _run(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence id, wants logits) entries as one llama.cpp batch."""
        b = self.batch.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self._llama_cpp.llama_decode(self.ctx.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")

    def _logits(self, index: int):
        """A view of llama.cpp's logits buffer for batch entry `index`: valid until the next decode."""
        import numpy as np

        ptr = self._llama_cpp.llama_get_logits_ith(self.ctx.ctx, index)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,))

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0, all_logits: bool = False):
        import numpy as np

        row = self._row_for_prefill(slot, start)
        self._truncate(row, start)  # positions from `start` on, if any, are rewritten
        n = len(prompt_ids)
        self._run([(t, start + i, row, all_logits or i == n - 1) for i, t in enumerate(prompt_ids)])
        self.rows.written(row, list(prompt_ids), start)
        if all_logits:
            return np.stack([self._logits(i) for i in range(n)])
        return self._logits(n - 1).copy()

    def embed(self, slot: int, ids: list[int], pooling: str):
        """llama.cpp's final hidden states (its "embeddings", before the output layer) for one
        prompt, read with embeddings switched on for this one decode."""
        import numpy as np

        lc = self._llama_cpp
        row = self._row_for_prefill(slot, 0)
        self._truncate(row, 0)
        n, every = len(ids), pooling == "mean"
        lc.llama_set_embeddings(self.ctx.ctx, True)
        try:
            self._run([(t, i, row, every or i == n - 1) for i, t in enumerate(ids)])
            dim = self._n_embd
            outputs = range(n) if every else [n - 1]
            vectors = [np.ctypeslib.as_array(lc.llama_get_embeddings_ith(self.ctx.ctx, i), shape=(dim,)).copy()
                       for i in outputs]
        finally:
            lc.llama_set_embeddings(self.ctx.ctx, False)
        self.rows.written(row, list(ids), 0)
        return np.mean(vectors, axis=0).astype(np.float32) if every else vectors[0].astype(np.float32)

    def decode(self, slots: list[int], tokens: list[int]):
        import numpy as np

        rows = [self.rows.row_of[s] for s in slots]
        positions = [len(self.rows.tokens[r]) for r in rows]
        self._run([(t, p, r, True) for r, t, p in zip(rows, tokens, positions)])
        for r, t, p in zip(rows, tokens, positions):
            self.rows.written(r, [t], p)
        return np.stack([self._logits(i) for i in range(len(slots))])  # one copy, out of llama.cpp's buffer


def default_threads() -> int:
    """Half the usable cores (at most 8): llama.cpp's threads spin while they wait, so using every
    core, or cores other processes need, slows decoding down by an order of magnitude."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // 2))


def check_file(path: Path, context: int | None) -> None:
    """The file's header and tensor table, and `context` against its trained context, read with
    gguf's reader (it maps the file and reads no weights): a truncated or corrupt file, or a context
    past the trained one, refused before the CLI binds its port and says "serving" (llama.cpp's load
    failed only after that).  A file without the context in its metadata is left to that load."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, IndexError, OSError) as e:  # what `quant inspect` says of such a file
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({e})") from None
    if not context:
        return
    try:
        arch = reader.fields["general.architecture"].contents()
        trained = reader.fields[f"{arch}.context_length"].contents()
    except (ValueError, IndexError, KeyError):
        return
    if isinstance(trained, int) and context > trained:
        raise ModelLoadError(f"exceeds the model's trained context of {trained} tokens", "context", context)


def load_gguf(path: Path, context: int | None, max_batch: int, max_queue: int, threads: int | None = None,
              prefix_cache: bool = True, kv_cache_dtype: str = "auto"):
    """Load a GGUF file; returns (LlamaCppBackend, LlamaCppTokenizer, EngineInfo)."""
    try:
        import llama_cpp
        from llama_cpp import _internals
    except ImportError as e:
        raise ModelLoadError("serving GGUF needs llama-cpp-python: pip install 'quantserve[quant]'") from e

    from llama_cpp import _logger

    _logger.set_verbose(False)  # llama.cpp's load chatter off; its errors still reach stderr
    llama_cpp.llama_backend_init()
    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = -1 if gpu else 0
    # Read the file into memory instead of mmap-ing it: llama.cpp computes straight from a mapping,
    # so a .gguf overwritten in place under a running server changes its weights, and a truncated
    # one kills it with SIGBUS.  (Deleting or renaming over the file is safe either way.)  Newer
    # bindings spell it load_mode (what their own `Llama(use_mmap=False)` sets), older ones use_mmap.
    if "load_mode" in dict(model_params._fields_):
        model_params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    else:
        model_params.use_mmap = False
    try:
        model = _internals.LlamaModel(path_model=str(path), params=model_params, verbose=False)
    except ValueError as e:
        raise ModelLoadError(f"{path}: llama.cpp cannot load this GGUF file ({e})") from e
    trained = model.n_ctx_train()
    if context and context > trained:
        raise ModelLoadError(f"exceeds the model's trained context of {trained} tokens", "context", context)
    context = context or trained
    if max_batch > llama_cpp.llama_max_parallel_sequences():
        raise ModelLoadError(f"exceeds llama.cpp's limit of {llama_cpp.llama_max_parallel_sequences()} "
                             "parallel sequences", "max_batch", max_batch)
    threads = threads or default_threads()
    try:
        backend = LlamaCppBackend(model, max_batch, context, threads, prefix_cache, kv_cache_dtype == "int8")
    except ValueError as e:  # llama.cpp refused the context (e.g. its KV cache types)
        raise ModelLoadError(f"{path}: llama.cpp cannot create a context for it ({e})") from e
    meta = model.metadata()
    file_type = _FILE_TYPES.get(int(meta.get("general.file_type", -1)), meta.get("general.file_type"))
    info = EngineInfo(engine="gguf", model_path=str(path), context_length=context, max_batch=max_batch,
                      max_queue=max_queue, device="cuda" if gpu else "cpu", dtype=str(file_type),
                      attention="llama.cpp", quantization=str(file_type),
                      extra={"gpu_offload": gpu, "threads": threads, "llama_cpp_python": llama_cpp.__version__,
                             "hidden_size": model.n_embd(),
                             "kv_cache_dtype": "q8_0" if kv_cache_dtype == "int8" else "f16"})
    return backend, LlamaCppTokenizer(model), info
