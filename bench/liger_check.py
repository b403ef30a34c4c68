"""Is Liger really applied?  Patch a small Llama on the GPU and report which modules/forwards
changed and the peak memory of one training step with and without it (same shapes, same run)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from quantserve.training.loading import apply_liger


def peak_step(liger: bool) -> float:
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    if liger:
        apply_liger(model, zero=None)
        print("forward:", getattr(model.forward, "__func__", model.forward).__module__,
              "| norm:", type(model.model.norm).__name__, "| mlp:", type(model.model.layers[0].mlp).__name__,
              "| mlp.forward:", getattr(model.model.layers[0].mlp.forward, "__func__", None).__module__)
    ids = torch.randint(0, cfg.vocab_size, (2, 4096), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, loss
    torch.cuda.empty_cache()
    return peak


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:  # --help included: it takes no options, and runs on a CUDA GPU only
        sys.exit(f"usage: python -m bench.liger_check (no options; a CUDA GPU)\n{__doc__.strip()}")
    if not torch.cuda.is_available():
        sys.exit("error: bench.liger_check needs a CUDA GPU")
    plain = peak_step(False)
    lig = peak_step(True)
    print(f"peak GiB: plain {plain:.2f}  liger {lig:.2f}  ratio {lig / plain:.2f}")
