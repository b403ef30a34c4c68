"""llama.cpp through llama-cpp-python: k-quantization, loading a GGUF, logits and tokenization.

Everything GGUF-related that must match what the server will run goes through llama.cpp itself:
its quantizer makes the k-quants (Q4_K_M needs its mixed per-tensor choices, which no numpy
re-implementation reproduces), and `quant eval` scores GGUF files with its forward pass.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from quantserve.settings import UserError

# our format suffix → llama.cpp file type (llama_ftype); all made from an F16 GGUF.
KQUANT_FTYPES = {
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q5_k_s": "LLAMA_FTYPE_MOSTLY_Q5_K_S",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
}


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError("GGUF k-quants and GGUF evaluation need llama-cpp-python "
                        "(pip install 'quantserve[quant]')") from e
    return llama_cpp


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what the C++ side prints straight to fd 2 (model-load chatter), errors included.

    Only used around calls whose failure we report ourselves.
    """
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def quantize(src_gguf: Path, dst_gguf: Path, kind: str) -> None:
    """k-quantize an F16/F32 GGUF with llama.cpp's own quantizer (`llama_model_quantize`)."""
    llama_cpp = _llama_cpp()

    if kind not in KQUANT_FTYPES:
        raise UserError(f"unknown llama.cpp quantization {kind!r} (known: {', '.join(KQUANT_FTYPES)})")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, KQUANT_FTYPES[kind])
    params.nthread = _threads()
    with quiet_native_stderr():
        rc = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(dst_gguf).encode(), params)
    if rc != 0 or not dst_gguf.is_file():
        # its own log is silenced above; the weights were checked (finite, F16-range) before,
        # so what is left is mostly the output file's write
        raise UserError(f"llama.cpp failed to quantize {src_gguf} to {kind.upper()} (code {rc}; "
                        "is the disk full or the output folder not writable?)")


GGML_TYPE_F32 = 0


def load(path: Path, n_ctx: int = 512, logits_all: bool = True):
    """A `llama_cpp.Llama`, quiet, with logits for every position when asked.

    All layers go to the GPU when this llama.cpp build has a GPU backend, as the server runs them
    (and on some GPU hosts llama.cpp's CPU backend crashes, so scoring there must not use it).
    The KV cache is F32 (llama.cpp's default is F16): evaluation must measure what the weight
    format costs, not the cache's rounding, which on some inputs alone moves logits by ~0.5 %."""
    llama_cpp = _llama_cpp()

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    try:
        with quiet_native_stderr():
            return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   logits_all=logits_all, n_threads=_threads(), verbose=False,
                                   n_gpu_layers=-1 if llama_cpp.llama_supports_gpu_offload() else 0,
                                   seed=0, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"{path}: llama.cpp cannot load this GGUF file ({e})") from e


def logits(llm, token_ids: list[int]):
    """Next-token logits (float32, one row per input position) from a fresh context."""
    import numpy as np

    llm.reset()
    llm.eval(token_ids)
    return np.array(llm.scores[: len(token_ids)], dtype=np.float32, copy=True)


def tokenize(llm, text: str, add_bos: bool = True) -> list[int]:
    """Token ids as llama.cpp makes them, special tokens in the text parsed as such."""
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def greedy(llm, prompt_ids: list[int], max_new_tokens: int = 16) -> list[int]:
    """Greedy continuation (stops at end-of-generation tokens)."""
    out: list[int] = []
    llm.reset()
    for tok in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        if llm.token_eos() == tok or len(out) >= max_new_tokens:
            break
        out.append(tok)
    return out


def version() -> str:
    try:
        import llama_cpp
        return llama_cpp.__version__
    except ImportError:
        return "not installed"
