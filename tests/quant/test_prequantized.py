"""AWQ and GPTQ checkpoints: written here by the formats' published layouts (bit by bit, not with
the reader's code), read back exactly, served by the fast engine from their own 4-bit integers,
converted by `quant convert`, and refused where they cannot be read (act-order, 3-bit).

No reference quantizer installs here without a CUDA torch (GPTQModel, AutoAWQ), so the writer
below follows the formats' specifications: AutoAWQ's GEMM packing (qweight [K, N/8], nibble i of
an int32 is column AWQ_ORDER[i]) and GPTQ's (qweight [K/8, N] along K, qzeros along N, zero
points stored minus one in the original format)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 64


def rtn(w: torch.Tensor, sym: bool):
    """Round-to-nearest 4-bit per group of GROUP inputs: (q [N, K], zeros [N, K/g], scales [N, K/g])."""
    N, K = w.shape
    g = w.float().reshape(N, K // GROUP, GROUP)
    if sym:
        s = g.abs().amax(-1).clamp(min=1e-8) / 7.5
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo).clamp(min=1e-8) / 15
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(g / s[..., None] + z[..., None]).clamp(0, 15)
    return q.reshape(N, K).to(torch.int64), z.to(torch.int64), s.half()


def pack(values: np.ndarray, axis: int, order) -> np.ndarray:
    """Eight 4-bit values per int32 along `axis`: nibble i of word j is element 8j + order[i]."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    words = np.zeros((v.shape[0] // 8, *v.shape[1:]), dtype=np.uint32)
    for j in range(words.shape[0]):
        for i, col in enumerate(order):
            words[j] |= v[8 * j + col] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words, 0, axis)).view(np.int32)


def write_checkpoint(default_model, out, method: str, sym: bool = False, v1: bool = True):
    """The default model with every decoder linear stored as `method`; returns {prefix: w_hat}."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(default_model.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out.mkdir()
    tensors, dequantized = {}, {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS):
            tensors[name] = t
            continue
        q, z, s = rtn(t, sym)
        dequantized[prefix] = (q - z.repeat_interleave(GROUP, 1)).float() * s.float().repeat_interleave(GROUP, 1)
        qT, zT, sT = q.t().numpy(), z.t().numpy(), s.t().contiguous()  # [K, N], [K/g, N]
        if method == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors[prefix + ".qweight"] = torch.from_numpy(pack(qT, 1, order))
            tensors[prefix + ".qzeros"] = torch.from_numpy(pack(zT, 1, order))
        else:
            tensors[prefix + ".qweight"] = torch.from_numpy(pack(qT, 0, range(8)))
            tensors[prefix + ".qzeros"] = torch.from_numpy(pack(zT - 1 if v1 else zT, 1, range(8)))
            tensors[prefix + ".g_idx"] = torch.arange(qT.shape[0], dtype=torch.int32) // GROUP
        tensors[prefix + ".scales"] = sT
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((default_model / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym, "desc_act": False,
         "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in default_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return dequantized


def reference_model(default_model, dequantized):
    """The default model with the dequantized weights in place: what every reader must compute."""
    from quantserve.modeling import load_model

    model = load_model(default_model)
    with torch.no_grad():
        for prefix, w in dequantized.items():
            model.get_submodule(prefix).weight.copy_(w)
    return model


VARIANTS = [("awq", False, True), ("gptq", False, True), ("gptq", True, True), ("gptq", False, False)]


@pytest.mark.parametrize("method, sym, v1", VARIANTS, ids=["awq", "gptq-asym", "gptq-sym", "gptq-v2"])
def test_layers_read_back_exactly_and_the_fast_engine_serves_them_as_stored(method, sym, v1, default_model, tmp_path):
    from quantserve.modeling import load_tokenizer
    from quantserve.quant.prequantized import dequantize, quantization_config, tensor_getter
    from quantserve.server.fastcore import FastCore
    from quantserve.server.fastcore.quant import Int4Linear

    want = write_checkpoint(default_model, tmp_path / "q", method, sym, v1)
    q = quantization_config(tmp_path / "q")
    get, _ = tensor_getter(tmp_path / "q")
    for prefix, w in want.items():
        assert torch.equal(dequantize(get, prefix, q), w), prefix
    ref = reference_model(default_model, want)
    core = FastCore(str(tmp_path / "q"), max_slots=2, max_seq=256, device="cpu", compile=False, weight_quant="int4")
    assert sum(isinstance(m, Int4Linear) for m in core.model.modules()) == 4 * len(core.model.layers)
    ids = load_tokenizer(default_model)("What is the capital of Keltria?")["input_ids"]
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(core.prefill(0, ids), logits, atol=1e-4, rtol=1e-4)
    tokens, last = [], core.prefill(1, ids)
    for i in range(8):
        tokens.append(int(last.argmax()))
        last = core.decode([1], [tokens[-1]], [len(ids) + i])[0]
    want_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(ids):].tolist()
    assert tokens == want_tokens


def test_convert_dequantizes_then_quantizes_again(default_model, tmp_path):
    """`quant convert` of an AWQ checkpoint to GGUF Q8_0 and bnb-int8: the manifest names the AWQ
    source, and llama.cpp's logits stay near the AWQ model's (Q8_0's own cost on top)."""
    from tests.support.gguf_checks import fresh_prompts, worst_relative_error

    from quantserve.modeling import load_tokenizer
    from quantserve.quant.convert import convert

    want = write_checkpoint(default_model, tmp_path / "awq", "awq")
    out = convert(tmp_path / "awq", "gguf-q8_0", tmp_path / "gguf", progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["path"] == str((tmp_path / "awq").resolve())
    assert "model.safetensors" in manifest["source"]["files_sha256"]
    assert not (out / ".dequantized-source").exists()
    err = worst_relative_error(out / "model.gguf", reference_model(default_model, want),
                               fresh_prompts(load_tokenizer(default_model))[:2])
    print(f"AWQ -> Q8_0: relative logit error {err:.2e}")
    assert err < 0.05
    assert (convert(tmp_path / "awq", "bnb-int8", tmp_path / "bnb", progress=False) / "manifest.json").is_file()


def test_served_through_the_api(default_model, tmp_path):
    """`quantserve serve` on a GPTQ folder: --engine auto takes the fast engine (it alone reads the
    format), health says so, and greedy answers are the dequantized model's."""
    import openai

    from tests.support.servers import ServerProcess

    from quantserve.modeling import generate_chat, load_tokenizer

    want = write_checkpoint(default_model, tmp_path / "gptq", "gptq")
    expected = generate_chat(reference_model(default_model, want), load_tokenizer(default_model),
                             ["What is 12 + 30?"], max_new_tokens=10)[0]
    srv = ServerProcess(tmp_path / "gptq", name="gptq")
    try:
        import httpx

        health = httpx.get(srv.base_url + "/health").json()
        assert health["engine"] == "fast" and "GPTQ" in health["engine_choice"]
        assert health["quantization"].startswith("gptq int4 g64")
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
        r = client.chat.completions.create(model="gptq", messages=[{"role": "user", "content": "What is 12 + 30?"}],
                                           max_tokens=10, temperature=0)
        assert r.choices[0].message.content == expected.strip() or r.choices[0].message.content == expected
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("change, message", [
    ({"desc_act": True}, "act-order"),
    ({"bits": 3}, "only 4-bit"),
    ({"group_size": -1}, "without groups"),
])
def test_what_cannot_be_read_is_one_clear_error(change, message, default_model, tmp_path):
    from quantserve.quant.prequantized import quantization_config
    from quantserve.settings import UserError

    write_checkpoint(default_model, tmp_path / "q", "gptq")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=message):
        quantization_config(tmp_path / "q")
