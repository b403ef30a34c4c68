"""`quantserve info MODEL`: which engines and formats take a model, from the same checks the
engines and the converter run (tiny random checkpoints; nothing but configs and headers is read)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.support.families import family_checkpoint

from quantserve.support import model_support


def verdicts(path) -> dict[str, tuple[bool, str]]:
    return {v["what"]: (v["ok"], v["why"]) for v in model_support(path)["verdicts"]}


@pytest.fixture(scope="module")
def tokenizer(default_model):
    from quantserve.modeling import load_tokenizer

    return load_tokenizer(default_model)


def test_the_default_model_goes_everywhere(default_model):
    report = model_support(default_model)
    assert report["architecture"] == "LlamaForCausalLM"
    assert all(v["ok"] for v in report["verdicts"]), report
    assert report["auto_engine"][0] in ("hf", "fast")


def test_a_gemma3_llama_cpp_would_scale_differently_is_refused_for_gguf_only(tokenizer, tmp_path):
    # the family's test config has query_pre_attn_scalar 24 against head_dim 32
    family_checkpoint("gemma3", tokenizer, tmp_path / "g3")
    v = verdicts(tmp_path / "g3")
    assert v["engine fast"][0] and v["engine hf"][0] and v["formats bnb-*"][0]
    assert not v["formats gguf-*"][0] and "query_pre_attn_scalar" in v["formats gguf-*"][1]


def test_an_architecture_no_engine_of_ours_runs(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(
        tmp_path / "gpt2")
    v = verdicts(tmp_path / "gpt2")
    assert v["engine hf"][0] and v["formats bnb-*"][0]
    assert not v["engine fast"][0] and "'gpt2'" in v["engine fast"][1]
    assert not v["formats gguf-*"][0] and "GPT2LMHeadModel" in v["formats gguf-*"][1]


def test_longrope_phi3_is_refused_by_the_fast_engine_with_the_reason(tokenizer, tmp_path):
    family_checkpoint("phi3", tokenizer, tmp_path / "phi3")
    cfg = json.loads((tmp_path / "phi3" / "config.json").read_text())
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half,
                           "original_max_position_embeddings": 128}
    (tmp_path / "phi3" / "config.json").write_text(json.dumps(cfg))
    v = verdicts(tmp_path / "phi3")
    assert not v["engine fast"][0] and "longrope" in v["engine fast"][1]


def test_awq_goes_to_the_fast_engine_not_to_transformers(default_model, tmp_path):
    from tests.support.prequantized import write_checkpoint

    write_checkpoint(default_model, tmp_path / "awq", "awq")
    report = model_support(tmp_path / "awq")
    v = {x["what"]: (x["ok"], x["why"]) for x in report["verdicts"]}
    assert v["engine fast"][0] and "AWQ" in v["engine fast"][1]
    assert not v["engine hf"][0] and "AutoAWQ" in v["engine hf"][1]
    assert v["formats gguf-*"][0]  # quant convert dequantizes first
    assert report["auto_engine"][0] == "fast"


def test_cli_prints_the_verdicts_and_fails_in_one_line(default_model, tmp_path):
    cmd = [sys.executable, "-m", "quantserve", "info"]
    r = subprocess.run(cmd + [str(default_model), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert {v["what"] for v in json.loads(r.stdout)["verdicts"]} >= {"engine fast", "engine hf", "formats gguf-*"}
    r = subprocess.run(cmd + [str(tmp_path / "missing")], capture_output=True, text=True)
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "notes.txt").write_text("hello")
    r = subprocess.run(cmd + [str(tmp_path / "notes.txt")], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_gguf_output_is_for_the_gguf_engine(tokenizer, tmp_path):
    from quantserve.quant.convert import convert

    family_checkpoint("qwen2", tokenizer, tmp_path / "qwen2", vocab_pad=8)
    out = convert(tmp_path / "qwen2", "gguf-f16", tmp_path / "gguf", progress=False)
    for path in (out, out / "model.gguf"):
        report = model_support(path)
        assert report["auto_engine"][0] == "gguf" and report["architecture"] == "qwen2"
        assert [v["ok"] for v in report["verdicts"]] == [True, False, False]
