"""The `fast` engine's loader: a Hugging Face checkpoint folder (fp16/fp32, or AWQ / GPTQ 4-bit)
served by FastCore behind the server's decode seam (adapter.py), with the checks that come first
and the EngineInfo the server reports.

    backend, tokenizer, info = load_fast(path, gpu_profile, context, max_batch, max_queue, "int8")
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from quantserve.server.config import EngineOptions
from quantserve.server.engine import EngineInfo
from quantserve.server.exceptions import ModelLoadError
from quantserve.server.hf_engine import HFTokenizer, quantization_of


def load_fast(path: Path, gpu_profile: str | None, context: int | None, max_batch: int, max_queue: int,
              weight_quant: str, prefix_cache: bool = True, kv_cache_dtype: str = EngineOptions.kv_cache_dtype,
              kv_blocks: int | None = None, batched_tokens: int | None = None):
    """The `fast` engine: server/fastcore's paged-KV decoder behind the same seam.
    Returns (FastCoreBackend, HFTokenizer, EngineInfo)."""
    from quantserve.capabilities import apply_profile, detect
    from quantserve.modeling import load_tokenizer
    from quantserve.quant.prequantized import quantization_config, quantization_problem
    from quantserve.server.fastcore.adapter import FastCoreBackend

    t0 = time.perf_counter()
    caps = detect(gpu_profile)
    apply_profile(caps)
    start_up = {"device": time.perf_counter() - t0}  # seconds of each part of the start-up, for /health
    problem = quantization_problem(path)
    if problem:
        raise ModelLoadError(problem)
    pre = quantization_config(path)
    if pre is None and quantization_of(path):
        raise ModelLoadError(f"{path}: a bitsandbytes checkpoint; the fast engine quantizes by itself: serve the "
                        "fp16/fp32 checkpoint with --engine fast --weight-quant int8|int4, or use --engine hf")
    if pre is not None and weight_quant == "none":
        weight_quant = "int4"  # an AWQ / GPTQ checkpoint is served as stored, not widened to fp16
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: only safetensors checkpoints are served (pickle *.bin files are refused)")
    trained = json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 2048
    if context and context > trained:
        raise ModelLoadError(f"exceeds the model's trained context of {trained} tokens", "context", context)
    context = context or trained
    _check_environment()
    compile_cache = kernel_table = None
    if caps.device == "cuda":
        from quantserve.server.fastcore.compile_cache import use_compile_cache
        from quantserve.server.fastcore.kernel_tables import shipped_table

        compile_cache = use_compile_cache(caps.gpu_name or "cuda")
        kernel_table = shipped_table(caps.gpu_name)
    t0 = time.perf_counter()
    try:
        backend = FastCoreBackend(str(path), max_batch, context, weight_quant=weight_quant, profile=caps.profile,
                                  prefix_cache=prefix_cache, kv_cache_dtype=kv_cache_dtype, kv_blocks=kv_blocks,
                                  max_batched_tokens=batched_tokens or EngineOptions().batched_tokens(),
                                  choices_file=compile_cache / "weight-kernels.json" if compile_cache else None,
                                  kernel_table=kernel_table)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"cannot run {path} ({e}); use the hf engine", "engine", "fast") from e
    core = backend.core
    start_up.update(core.start_up, **{"warm-up": backend.warm_up_s})
    start_up["other"] = time.perf_counter() - t0 - sum(core.start_up.values()) - backend.warm_up_s
    t0 = time.perf_counter()
    tokenizer = HFTokenizer(load_tokenizer(path))
    start_up["tokenizer"] = time.perf_counter() - t0
    info = EngineInfo(engine="fast", model_path=str(path), context_length=context, max_batch=max_batch,
                      max_queue=max_queue, device=str(core.device), dtype=str(core.dtype).replace("torch.", ""),
                      attention=f"{core.attention} (paged KV cache, {core.pool.num_blocks} blocks of 16 tokens)",
                      kv_pool_tokens=core.pool.capacity_tokens,
                      quantization=(f"{pre['method']} int4 g{pre['group_size']} (repacked)" if pre and weight_quant == "int4"
                                    else None if weight_quant == "none" else f"{weight_quant} weight-only"),
                      extra={"gpu_profile": caps.profile, "gpu": caps.gpu_name, "compiled": core.compile,
                             "max_num_batched_tokens": batched_tokens or EngineOptions().batched_tokens(),
                             "kv_blocks": core.pool.num_blocks, "load_s": round(core.load_seconds, 1),
                             "hidden_size": core.args.dim,
                             "kv_cache_dtype": "int8" if core.kv_int8 else str(core.dtype).replace("torch.", ""),
                             "warm_up_s": round(getattr(backend, "warm_up_s", 0.0), 1),
                             "compile_cache": str(compile_cache) if compile_cache else None,
                             "kernel_table": kernel_table.name if kernel_table else None,
                             "kernel_choices_loaded": core.kernel_choices_loaded,
                             "start_up_s": {part: round(t, 2) for part, t in start_up.items()}})
    return backend, tokenizer, info


def _check_environment() -> None:
    """The fast engine's environment variables, read now: a bad one is the user's to fix (one line),
    not a reason to suggest another engine."""
    from quantserve.server.fastcore.attention import short_context
    from quantserve.server.fastcore.fused import fused_decode_forms

    try:
        fused_decode_forms("int8")
        short_context()
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
