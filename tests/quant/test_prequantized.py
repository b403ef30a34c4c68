"""AWQ and GPTQ checkpoints: written here by the formats' published layouts (bit by bit, not with
the reader's code), read back exactly, served by the fast engine from their own 4-bit integers,
converted by `quant convert`, and refused where they cannot be read (act-order, 3-bit).

The writer (tests/support/prequantized.py) follows the formats' specifications: no reference
quantizer installs here without a CUDA torch (GPTQModel, AutoAWQ)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.prequantized import write_checkpoint

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
        last = core.decode([1], [tokens[-1]])[0]
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
