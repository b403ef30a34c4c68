"""quant: every format converts, reloads in its engine and generates; GGUF matches transformers.

All on the real default model and the real engines (bitsandbytes' CPU kernels, llama.cpp's
portable CPU build).  Conversions are shared per module; each takes about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from quantserve.quant import llamacpp
from quantserve.formats import CONVERT_FORMATS as FORMATS
from quantserve.quant.convert import convert
from quantserve.quant.manifest import kv_cache_bytes
from quantserve.quant.source import sha256_file
from tests.support.families import FAMILIES
from tests.support.gguf_checks import chat_ids, fresh_prompts, hf_logits, worst_relative_error

# Relative logit error ‖L_gguf − L_hf‖ / ‖L_hf‖ allowed per prompt (llama.cpp vs transformers
# fp32).  Measured on the trained default model: F32 ~1.3e-4, F16 ~1.8e-4, Q8_0 ~3.7e-3; a
# missing Q/K permutation or a wrong rope base gives > 0.1 (see the negative controls below).
TOLERANCE = {"gguf-f32": 5e-4, "gguf-f16": 2e-3, "gguf-q8_0": 1e-2}


TRICKY_STRINGS = [
    "hello world", " leading space", "trailing space ", "two  spaces", "   three leading",
    "tabs\tand\nnewlines\n\n", "\n", "a\r\nb", "don't I'm we'll they've",
    "héllo wörld café naïve", "日本語のテキスト", "emoji 👋🏽 and 🚀!", "Ωmega ßharp",
    "digits 1234567890 3.14159 1,000,000", "42", "x=-7.5e-3", "CamelCaseWord snake_case",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "<s>already has bos", "text with <pad> inside", "<|im_end|><|im_end|>",
    "<|im_start|> spaced <|im_end|>", "punctuation!!! ??? ... ---", "",
]


@pytest.fixture(scope="module")
def outputs(default_model, tmp_path_factory):
    """Convert lazily, once per format: outputs[fmt] is the output folder."""
    root = tmp_path_factory.mktemp("quant")

    class Lazy(dict):
        def __missing__(self, fmt):
            self[fmt] = convert(default_model, fmt, root / fmt, progress=False)
            return self[fmt]
    return Lazy()


@pytest.fixture(scope="module")
def hf(default_model):
    from quantserve.modeling import load_model, load_tokenizer

    return load_model(default_model), load_tokenizer(default_model)


# --- GGUF ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["gguf-f32", "gguf-f16", "gguf-q8_0"])
def test_gguf_logits_match_transformers(fmt, outputs, hf):
    model, tok = hf
    err = worst_relative_error(outputs[fmt] / "model.gguf", model, fresh_prompts(tok))
    print(f"{fmt}: worst relative logit error {err:.2e} (tolerance {TOLERANCE[fmt]:.0e})")
    assert err < TOLERANCE[fmt]


def test_worker_process_gives_the_in_process_logits(outputs):
    """`quant eval` scores GGUF files in a llama.cpp worker process that never imports torch."""
    from quantserve.quant.llamacpp_worker import LogitsWorker

    gguf_file = outputs["gguf-q8_0"] / "model.gguf"
    windows = [list(range(1, 40)), list(range(5, 130))]
    llm = llamacpp.load(gguf_file, n_ctx=128)
    try:
        expected = [llamacpp.logits(llm, w) for w in windows]
    finally:
        llm.close()
    with LogitsWorker(gguf_file, n_ctx=128) as worker:
        for w, want in zip(windows, expected):
            np.testing.assert_array_equal(worker.logits(w), want)
    probe = "import sys, quantserve.quant.llamacpp_worker; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_worker_crash_and_bad_file_are_one_clear_error(outputs, tmp_path):
    import signal

    from quantserve.quant.llamacpp_worker import LogitsWorker, quantize
    from quantserve.settings import UserError

    with LogitsWorker(outputs["gguf-q8_0"] / "model.gguf", n_ctx=64) as worker:
        worker.logits([1, 2, 3])
        worker.proc.send_signal(signal.SIGSEGV)  # what llama.cpp did on one GPU host
        with pytest.raises(UserError, match=r"llama.cpp crashed \(SIGSEGV\) while scoring"):
            worker.logits([1, 2, 3])
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with LogitsWorker(bad, n_ctx=64) as worker, pytest.raises(UserError, match="cannot load this GGUF"):
        worker.logits([1, 2, 3])
    with pytest.raises(UserError, match="unknown llama.cpp quantization"):
        quantize(bad, tmp_path / "out.gguf", "q9_x")

@pytest.mark.parametrize("breakage", ["no Q/K permutation", "wrong rope base"])
def test_logit_check_catches_a_broken_converter(breakage, default_model, hf, tmp_path, monkeypatch):
    """Negative control: the F16 tolerance is tight enough to fail a subtly wrong GGUF."""
    import quantserve.quant.gguf_export as gx
    if breakage == "no Q/K permutation":
        monkeypatch.setattr(gx, "permute_rotary", lambda w, n_head: w)
    else:
        real = gx.hyperparameters
        monkeypatch.setattr(gx, "hyperparameters", lambda ckpt: {**real(ckpt), "rope_theta": 500000.0})
    out = convert(default_model, "gguf-f16", tmp_path / "broken", progress=False)
    model, tok = hf
    err = worst_relative_error(out / "model.gguf", model, fresh_prompts(tok))
    print(f"{breakage}: relative logit error {err:.2e}")
    assert err > 20 * TOLERANCE["gguf-f16"]


def test_gguf_tokenizer_matches_hugging_face(outputs, hf):
    _, tok = hf
    llm = llamacpp.load(outputs["gguf-f16"] / "model.gguf", n_ctx=64, logits_all=False)
    try:
        for text in TRICKY_STRINGS:
            expected = tok(text).input_ids  # BOS from the post-processor, specials parsed
            assert llamacpp.tokenize(llm, text) == expected, repr(text)
            # and back: llama.cpp detokenizes to the same text (specials rendered)
            assert llm.detokenize(expected[1:], special=True).decode("utf-8") == text, repr(text)
    finally:
        llm.close()


def test_gguf_metadata(outputs, default_model):
    from quantserve.quant.inspect import inspect

    info = inspect(outputs["gguf-f16"] / "model.gguf")
    md = info["metadata"]
    cfg = json.loads((default_model / "config.json").read_text())
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == cfg["num_hidden_layers"]
    assert md["llama.attention.head_count_kv"] == cfg["num_key_value_heads"] == 2
    assert md["llama.rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.ggml.eos_token_id"] == cfg["eos_token_id"]
    assert md["tokenizer.chat_template"].startswith("{{ bos_token }}")
    assert info["tensor_types"] == {"F32": 9, "F16": 30}  # norms F32, every matrix F16
    q8 = inspect(outputs["gguf-q8_0"] / "model.gguf")
    assert q8["tensor_types"] == {"F32": 9, "Q8_0": 30}


# Greedy decoding along transformers' path, scored where transformers is decisive.  A quantized
# model may flip a near-tie (and which way depends on the CPU's arithmetic: on one machine Q4_K_M
# wrote 'b f i j', on another 'b f g i'), so a step counts only where transformers' top-2 logit
# gap exceeds DECISIVE[fmt]; there the top tokens must agree, and over all steps at least
# AGREEMENT[fmt] of them.
DECISIVE = {"gguf-f16": 0.05, "gguf-q8_0": 0.25, "gguf-q4_k_m": 1.0}
AGREEMENT = {"gguf-f16": 0.95, "gguf-q8_0": 0.9, "gguf-q4_k_m": 0.75}
GREEDY_PROMPTS = ["What is 12 + 30?", "How many letters?\nd a c b", "What is the capital of Zafira?",
                  "Sort: d a c b", "Repeat: k l m", "What comes after q?"]


@pytest.mark.parametrize("fmt", ["gguf-f16", "gguf-q8_0", "gguf-q4_k_m"])
def test_gguf_generates_like_transformers(fmt, outputs, hf):
    """llama.cpp's next token equals transformers' at every decisive step of its greedy answers."""
    import torch

    model, tok = hf
    llm = llamacpp.load(outputs[fmt] / "model.gguf", n_ctx=128)
    steps = agree = 0
    try:
        for prompt in GREEDY_PROMPTS:
            ids = chat_ids(tok, prompt)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            path = out[0].tolist()
            ref, got = hf_logits(model, path), llamacpp.logits(llm, path)
            for pos in range(len(ids) - 1, len(path) - 1):
                top2 = np.sort(ref[pos])[-2:]
                same = int(got[pos].argmax()) == int(ref[pos].argmax())
                steps, agree = steps + 1, agree + same
                if top2[1] - top2[0] > DECISIVE[fmt]:
                    assert same, (prompt, tok.decode(path[len(ids):pos + 1]), float(top2[1] - top2[0]))
    finally:
        llm.close()
    print(f"{fmt}: top-1 agreement {agree}/{steps} along transformers' greedy path")
    assert agree / steps >= AGREEMENT[fmt]


def test_kquant_really_uses_k_blocks(outputs):
    from quantserve.quant.inspect import gguf_tensor_types

    manifest = json.loads((outputs["gguf-q4_k_m"] / "manifest.json").read_text())
    types = gguf_tensor_types(outputs["gguf-q4_k_m"] / "model.gguf")
    assert manifest["conversion"]["tensor_types"] == types
    assert types.get("Q4_K", 0) >= 20 and types["F32"] == 9  # Q4_K_M mixes in Q6_K for some
    assert sorted(p.name for p in outputs["gguf-q4_k_m"].iterdir()) == ["manifest.json", "model.gguf"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_config_variants(arch, default_model, tmp_path):
    """Mistral (Llama graph), Qwen2 (q/k/v biases, NEOX rotary: no permutation) and Qwen3 (q/k
    RMSNorm per head, a head width of its own), Phi-3 (fused qkv and gate/up) and Gemma 2 (1 + w
    norms, sandwich norms, soft-caps, a sliding window shorter than the prompts) and Gemma 3 (q/k
    norms, a local rope on its sliding layers) convert exactly.

    Random weights, so the bound is F32's: a missing or extra permutation gives ~2e-2 here.
    """
    from tests.support.families import family_checkpoint

    from quantserve.modeling import load_tokenizer

    tok = load_tokenizer(default_model)
    # not named after the family: llama.cpp expects Phi-3's own special tokens (</s>, <unk>, ...) in
    # any model whose name says "phi3", and this one has the default model's tokenizer
    model = family_checkpoint(arch, tok, tmp_path / "src", vocab_pad=8,  # [PADn] rows in the GGUF
                              hidden=256, ffn=768, context=512,
                              # llama.cpp scales queries by head_dim ** -0.5; every Gemma ties its embeddings
                              gemma2={"head_dim": 48, "query_pre_attn_scalar": 48, "sliding_window": 8, "tie": True})
    out = convert(tmp_path / "src", "gguf-f32", tmp_path / "out", progress=False)
    from quantserve.quant.inspect import inspect
    assert inspect(out / "model.gguf")["architecture"] == {"mistral": "llama"}.get(arch, arch)
    err = worst_relative_error(out / "model.gguf", model, fresh_prompts(tok)[:3])
    print(f"{arch}: relative logit error {err:.2e}")
    assert err < 1e-3


def test_a_gemma_config_may_leave_tied_embeddings_to_its_class(default_model, tmp_path):
    """Published Gemma 2 configs have no tie_word_embeddings key (the class's default is True) and
    their checkpoints no lm_head: that converts; a Gemma with an lm_head of its own is refused by
    name (llama.cpp's gemma graphs take the logits from the embedding)."""
    from tests.support.families import family_checkpoint

    from quantserve.modeling import load_tokenizer
    from quantserve.settings import UserError

    tok = load_tokenizer(default_model)
    gemma = {"head_dim": 48, "query_pre_attn_scalar": 48, "sliding_window": 8}
    family_checkpoint("gemma2", tok, tmp_path / "tied", vocab_pad=8, gemma2={**gemma, "tie": True})
    cfg = json.loads((tmp_path / "tied" / "config.json").read_text())
    cfg.pop("tie_word_embeddings", None)
    (tmp_path / "tied" / "config.json").write_text(json.dumps(cfg))
    assert (convert(tmp_path / "tied", "gguf-f16", tmp_path / "out", progress=False) / "model.gguf").is_file()
    family_checkpoint("gemma2", tok, tmp_path / "untied", vocab_pad=8, gemma2=gemma)
    with pytest.raises(UserError, match="takes the logits from the embedding"):
        convert(tmp_path / "untied", "gguf-f16", tmp_path / "out2", progress=False)


# --- bitsandbytes ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bnb-int8", "bnb-nf4", "bnb-fp4"])
def test_bnb_round_trip_and_generate(fmt, outputs, hf, default_model):
    """Reloaded weights are the quantized ones (not re-quantized or lost) and generate."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantserve.quant.bnb import load_bnb, quantization_config
    from quantserve.modeling import generate_chat

    model, tok = hf
    fresh = AutoModelForCausalLM.from_pretrained(str(default_model), quantization_config=quantization_config(fmt),
                                                 device_map="cpu", dtype=torch.float32).eval()
    reloaded = load_bnb(outputs[fmt])
    cls = "Linear8bitLt" if fmt == "bnb-int8" else "Linear4bit"
    assert sum(type(m).__name__ == cls for m in reloaded.modules()) == 4 * 7
    ids = fresh_prompts(tok)[0]
    a, b = hf_logits(fresh, ids), hf_logits(reloaded, ids)
    assert np.abs(a - b).max() < 1e-4, "save → reload changed the quantized model"
    ref = hf_logits(model, ids)
    rel = np.linalg.norm(b - ref) / np.linalg.norm(ref)
    assert rel < {"bnb-int8": 0.05, "bnb-nf4": 0.3, "bnb-fp4": 0.4}[fmt], rel
    answer = generate_chat(reloaded, tok, ["What is 12 + 30?"], max_new_tokens=8)[0]
    assert answer.strip(), "generated nothing"


# --- manifest, eval, inspect ------------------------------------------------------------------

def test_manifest(outputs, default_model):
    out = outputs["gguf-q8_0"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "gguf-q8_0" and m["gguf_file"] == "model.gguf"
    assert m["source"]["path"] == str(default_model.resolve())
    assert m["source"]["files_sha256"]["model.safetensors"] == sha256_file(default_model / "model.safetensors")
    assert m["tensor_count"] == 39
    assert m["size_bytes"] == sum(p.stat().st_size for p in out.iterdir() if p.name != "manifest.json")
    cfg = json.loads((default_model / "config.json").read_text())
    mem = m["serving_memory"]
    assert mem["context"] == 512
    assert mem["kv_cache_bytes"] == kv_cache_bytes(cfg, 512) == 2 * 4 * 2 * 64 * 512 * 2
    assert mem["total_bytes"] == (out / "model.gguf").stat().st_size + mem["kv_cache_bytes"]
    assert m["tool_versions"]["gguf"] and m["tool_versions"]["llama_cpp_python"] != "not installed"


def test_eval_quality_ordering(outputs, default_model, small_heldout):
    from quantserve.quant.evaluate import evaluate

    rows = {fmt: evaluate(default_model, outputs[fmt], small_heldout)
            for fmt in ("gguf-f16", "gguf-q8_0", "bnb-int8", "gguf-q4_k_m", "bnb-nf4")}
    for fmt, row in rows.items():
        print(fmt, row)
        assert json.loads((outputs[fmt] / "manifest.json").read_text())["quality"] == row
        assert row["ppl_source"] == rows["gguf-f16"]["ppl_source"]
    f16, q8, i8 = rows["gguf-f16"], rows["gguf-q8_0"], rows["bnb-int8"]
    assert f16["top1_agreement"] > 0.99 and abs(f16["delta_pct"]) < 0.1
    for close in (q8, i8):  # 8-bit: close to the source
        assert close["top1_agreement"] > 0.97 and abs(close["delta_pct"]) < 1.0
    for four in (rows["gguf-q4_k_m"], rows["bnb-nf4"]):  # 4-bit: worse, but bounded
        assert four["rel_logit_error"] > q8["rel_logit_error"]
        assert four["top1_agreement"] > 0.8 and four["delta_pct"] < 15
    assert q8["size_mib"] < f16["size_mib"] and rows["gguf-q4_k_m"]["size_mib"] < q8["size_mib"]


def test_eval_rejects_a_foreign_model(outputs, tmp_path, small_heldout):
    from quantserve.quant.evaluate import evaluate
    from quantserve.settings import UserError

    with pytest.raises(UserError, match="no such file"):
        evaluate(tmp_path / "missing", outputs["gguf-q8_0"], small_heldout)
    with pytest.raises(UserError, match="not a"):
        evaluate(outputs["gguf-q8_0"], outputs["gguf-q8_0"], small_heldout)


def test_eval_refuses_a_conversion_of_another_checkpoint(outputs, default_model, tmp_path, small_heldout):
    """The manifest names its source by hash: scoring it against another checkpoint (a fine-tune of
    the same shape, here the default model with one weight changed) is refused, and the manifest's
    quality row is left as it was."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from quantserve.quant.evaluate import evaluate
    from quantserve.settings import UserError

    other = tmp_path / "other"
    shutil.copytree(default_model, other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights, metadata={"format": "pt"})
    before = json.loads((outputs["gguf-q8_0"] / "manifest.json").read_text())
    with pytest.raises(UserError, match="another checkpoint"):
        evaluate(other, outputs["gguf-q8_0"], small_heldout)
    assert json.loads((outputs["gguf-q8_0"] / "manifest.json").read_text()) == before


def test_lora_adapter_is_merged_first(default_model, hf, tmp_path):
    """A LoRA adapter folder converts to the merged model (checked against peft's own output)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from quantserve.modeling import load_model

    torch.manual_seed(0)
    base = load_model(default_model)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                     init_lora_weights=False)  # random B: the adapter really changes the model
    with torch.enable_grad():  # grad modes set in a block, never process-wide: later tests train
        peft_model = get_peft_model(base, cfg)
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg_file = tmp_path / "adapter" / "adapter_config.json"
    acfg = json.loads(cfg_file.read_text())
    acfg["base_model_name_or_path"] = str(default_model)
    cfg_file.write_text(json.dumps(acfg))

    out = convert(tmp_path / "adapter", "gguf-f32", tmp_path / "merged", progress=False)
    _, tok = hf
    prompts = fresh_prompts(tok)[:3]
    with torch.no_grad():
        err = worst_relative_error(out / "model.gguf", peft_model.eval(), prompts)
        base_err = worst_relative_error(out / "model.gguf", hf[0], prompts)
    assert err < TOLERANCE["gguf-f32"]
    assert base_err > 10 * err, "the adapter changed nothing: the test would prove nothing"
    m = json.loads((out / "manifest.json").read_text())
    assert m["source"]["lora_base"] == str(default_model.resolve())
    assert "adapter/adapter_model.safetensors" in m["source"]["files_sha256"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.gguf"]


# --- formats -----------------------------------------------------------------------------------

def test_formats_cover_the_issue():
    for fmt in ("bnb-int8", "bnb-nf4", "bnb-fp4", "gguf-f16", "gguf-q8_0", "gguf-q4_k_m"):
        assert fmt in FORMATS


@pytest.mark.parametrize("fmt", ["bnb-int8", "gguf-q8_0"])
def test_outputs_are_readable_by_other_users(fmt, outputs):
    """safetensors writes 0600; a server running as another user (a container's uid) must read them."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    for f in outputs[fmt].iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, (f.name, oct(f.stat().st_mode))
