"""What folding each RMSNorm's weight into the linear layers after it costs in int8 / int4 quality:
W' = W diag(gamma) before quantization, the norm's weight set to 1 (the function is the same in
exact arithmetic; only the quantization grid moves).  Against the unquantized, unfolded model, on
the default model's held-out windows, as bench/quality.py scores them (CPU, fp32)."""
import json
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

import quantserve.demo  # noqa: F401
from quantserve.bench.quality import compare, score, windows
from quantserve.demo.default_model import default_model_path
from quantserve.modeling import load_tokenizer
from quantserve.server.fastcore import FastCore

torch.set_grad_enabled(False)
src = default_model_path(progress=False)
tok = load_tokenizer(src)
wins = windows(tok, int(sys.argv[1]) if len(sys.argv) > 1 else 16, 256)


def folded_copy(out: str) -> str:
    m = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    for layer in m.model.layers:
        g = layer.input_layernorm.weight.data.clone()
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.weight.data *= g[None, :]
        layer.input_layernorm.weight.data.fill_(1.0)
        g = layer.post_attention_layernorm.weight.data.clone()
        for lin in (layer.mlp.gate_proj, layer.mlp.up_proj):
            lin.weight.data *= g[None, :]
        layer.post_attention_layernorm.weight.data.fill_(1.0)
    g = m.model.norm.weight.data.clone()
    m.lm_head.weight.data *= g[None, :]  # untied in the default model
    m.model.norm.weight.data.fill_(1.0)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def core(path, weights):
    return FastCore(str(path), max_slots=1, max_seq=256, compile=False, weight_quant=weights)


ref = score(core(src, "none"), wins)
with tempfile.TemporaryDirectory() as d:
    fold = folded_copy(d)
    rows = [{"weights": "none", "norms": "folded", **compare(ref, score(core(fold, "none"), wins), wins)}]
    for w in ("int8", "int4"):
        for name, path in (("as they are", src), ("folded", fold)):
            rows.append({"weights": w, "norms": name, **compare(ref, score(core(path, w), wins), wins)})
for r in rows:
    print(json.dumps(r))
