"""fastcore: a paged-KV-cache, CUDA-graph engine core for Llama-family models (gpt-fast style).

architectures.py  the model families it runs: one table entry per config.json model_type
model.py     the decoder over a flattened batch of tokens and the paged KV cache
blocks.py    the KV pool's blocks, each sequence's block table, prefix caching by block hashes
batch.py     one forward's input: the new tokens of several sequences laid end to end
attention.py attention over the pages: the torch reference / CPU path, and the choice of kernel
triton_paged_attention.py  the same as one Triton kernel (the GPU path)
weights.py   where the weights come from (checkpoint, AWQ / GPTQ, random) and the model built from them
quant.py     weight-only int8 / int4 linear layers, quantized at load
triton_mm.py the Triton int8 / int4 matmul kernels those layers use on a GPU
triton_gemv.py  batch-1 matrix-vector variants, kept per layer shape where they are faster
graphs.py    the compiled block (every layer, any batch) and the decode steps' CUDA graphs per bucket
core.py      FastCore: one step of decodes and prompt chunks together, warm-up; ties the above together
adapter.py   FastCore behind the server's decode seam (sampling is the server's, per request)
loader.py    the `fast` engine's loader: checks, FastCoreBackend, EngineInfo
"""

from quantserve.server.fastcore.core import FastCore

__all__ = ["FastCore"]
