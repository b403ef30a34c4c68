"""fastcore: a static-KV-cache, CUDA-graph decode core for Llama-family models (gpt-fast style).

model.py   the decoder and its slot-addressed static KV cache
quant.py   weight-only int8 / int4 linear layers, quantized at load
core.py    FastCore: slots, prefill, batched decode at per-slot positions, compiled steps
sampler.py per-request temperature / top-p / top-k / penalties / seed
"""

from server.fastcore.core import FastCore
from server.fastcore.sampler import SamplingParams, sample

__all__ = ["FastCore", "SamplingParams", "sample"]
