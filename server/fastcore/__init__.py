"""fastcore: a static-KV-cache, CUDA-graph decode core for Llama-family models (gpt-fast style).

model.py     the decoder and its slot-addressed static KV cache
quant.py     weight-only int8 / int4 linear layers, quantized at load
triton_mm.py the Triton int8 / int4 matmul kernels those layers use on a GPU
triton_gemv.py  batch-1 matrix-vector variants, kept per layer shape where they are faster
core.py      FastCore: slots, prefill, batched decode at per-slot positions, compiled steps
adapter.py   FastCore behind the server's decode seam (sampling is the server's, per request)
"""

from quantserve.server.fastcore.core import FastCore

__all__ = ["FastCore"]
