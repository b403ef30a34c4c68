"""fastcore: a static-KV-cache, CUDA-graph decode core for Llama-family models (gpt-fast style).

architectures.py  the model families it runs: one table entry per config.json model_type
model.py     the decoder and its slot-addressed static KV cache
weights.py   where the weights come from (checkpoint, AWQ / GPTQ, random) and the model built from them
quant.py     weight-only int8 / int4 linear layers, quantized at load
triton_mm.py the Triton int8 / int4 matmul kernels those layers use on a GPU
triton_gemv.py  batch-1 matrix-vector variants, kept per layer shape where they are faster
graphs.py    the compiled decode and prompt steps, and their CUDA graphs per padded shape
slots.py     which cache slots are live, and how long each one's sequence is
core.py      FastCore: prefill, batched decode at per-slot positions, warm-up; ties the above together
adapter.py   FastCore behind the server's decode seam (sampling is the server's, per request)
loader.py    the `fast` engine's loader: checks, FastCoreBackend, EngineInfo
"""

from quantserve.server.fastcore.core import FastCore

__all__ = ["FastCore"]
