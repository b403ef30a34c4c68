"""The check behind RESULTS.md's "a two-layer Llama, fused against separate ops" (2026-12-05): the
fast core on the CPU with its int8 / int4 layers routed through the fused batch-1 kernels, which
run in Triton's interpreter, against the same core with the separate ops.

    PYTHONPATH=<a Triton install> python check_model_interpreted.py int8|int4 [--compile]

On a CPU fused.py never takes the fused path (it asks for a CUDA tensor), so this script lifts that
one condition and sets each layer's batch-1 choice to the matrix-vector kernel (the launcher would
time it on a GPU).  --compile: through torch.compile's compiled blocks, as the server runs them
(inductor's CPU backend; the custom ops stay calls into the interpreter).
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from quantserve.server.fastcore import fused, triton_fused, triton_gemv, triton_mm  # noqa: E402,F401  (triton_fused: registers the ops)
from quantserve.server.fastcore.core import FastCore  # noqa: E402
from quantserve.server.fastcore.quant import Int4Linear, Int8Linear  # noqa: E402

mode, compiled = sys.argv[1], "--compile" in sys.argv
fused._one_token_fusable = lambda linear, x: x.shape[0] == 1 and getattr(linear, "fusable", False)
cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
core = FastCore(None, random_config=cfg, max_slots=2, max_seq=256, device="cpu", weight_quant=mode,
                quant_kernel="torch", compile=compiled)
layers = [m for m in core.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
gemv = triton_gemv.int8_gemv_kernel if mode == "int8" else triton_gemv.int4_gemv_kernel
config = triton_gemv._config(8, 512, 4) if mode == "int8" else triton_gemv._config(8, 256, 1)
for m in layers:
    N, K = m.weight.shape[0], m.weight.shape[1] * (2 if mode == "int4" else 1)
    key = (f"_{mode}_kernel", 16, True, N, K, torch.float32, None if mode == "int8" else m.group_size)
    triton_mm._chosen[key] = (gemv.fn, config, 1, {"BIT_DEQUANT": False})


def run(fusable: bool) -> torch.Tensor:
    """The logits of a 39-token prompt's step and two one-token steps after it."""
    for m in layers:
        m.fusable = fusable
    slot = core.acquire()
    first = core.step([(slot, list(range(1, 40)))])
    a, b = core.step([(slot, [7])]), core.step([(slot, [8])])
    core.release(slot)
    return torch.cat([first, a, b])


separate, together = run(False), run(True)
print(f"{mode}{' compiled' if compiled else ''}: max |difference| {(separate - together).abs().max().item():.3g} "
      f"on logits up to {separate.abs().max().item():.3g}; same greedy tokens: "
      f"{separate.argmax(-1).tolist() == together.argmax(-1).tolist()}")
