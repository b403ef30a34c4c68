"""Checkpoints whose weights do not fit their config.json, weights that are NaN / Inf, k-quants whose
rows are not whole blocks, and config sizes that are zero or negative: each is refused in one line
naming the tensor or field (or, for the fallbacks, noted), before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantserve.settings import UserError
from tests.support.cli import quant_cli as run_cli


def one_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


def edited_copy(default_model: Path, folder: Path, config: dict | None = None, tensors=None) -> Path:
    """The default model with config.json fields replaced and/or its tensors passed through `tensors`."""
    shutil.copytree(default_model, folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        from safetensors.torch import load_file, save_file

        weights = folder / "model.safetensors"
        save_file(tensors(load_file(weights)), weights, metadata={"format": "pt"})
    return folder


def _drop_q_proj(sd):
    del sd["model.layers.2.self_attn.q_proj.weight"]
    return sd


def _nan_and_inf(sd):
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    return sd


MISMATCHES = {  # name → (config changes, tensor edit, what the error line must say)
    "missing-tensor": ({}, _drop_q_proj, "missing: model.layers.2.self_attn.q_proj.weight"),
    "more-layers": ({"num_hidden_layers": 8}, None, "missing: model.layers.4."),
    "wider": ({"hidden_size": 512}, None, "wrong shape: lm_head.weight [742, 256] (config: [742, 512])"),
    "other-model": ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, None,
                    "not in the model: model.embed_tokens.weight"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_weights_that_do_not_fit_the_config_are_refused(case, default_model, tmp_path, monkeypatch, capsys):
    from quantserve.modeling import load_model
    from quantserve.training.loading import check_model

    config, tensors, want = MISMATCHES[case]
    src = edited_copy(default_model, tmp_path / case, config, tensors)
    formats = ("bnb-int8",) if case == "other-model" else ("gguf-q8_0", "bnb-int8")  # GGUF: no GPT-2 at all
    for fmt in formats:
        line = one_error(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt,
                                  "-o", str(tmp_path / fmt), "-q")[::2])
        assert "its weights do not match its config.json" in line and want in line, line
        assert not (tmp_path / fmt).exists()
    for load in (check_model, load_model):  # what `train` and `generate` run
        with pytest.raises(UserError, match="do not match its config.json") as e:
            load(src)
        assert want in str(e.value)


def test_tied_and_matching_checkpoints_still_pass(default_model, tmp_path):
    """lm_head absent under tie_word_embeddings is not "missing"; the default model passes as is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantserve.modeling import check_checkpoint

    check_checkpoint(default_model)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=100, tie_word_embeddings=True)).save_pretrained(tmp_path / "tied")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tied" / "model.safetensors"), framework="pt") as st:
        assert "lm_head.weight" not in st.keys()
    check_checkpoint(tmp_path / "tied")
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "gguf-q4_k_m", "bnb-int8"])
def test_non_finite_weights_are_named(fmt, default_model, tmp_path, monkeypatch, capsys):
    if fmt == "gguf-q4_k_m":
        pytest.importorskip("llama_cpp")
    src = edited_copy(default_model, tmp_path / "nan", tensors=_nan_and_inf)
    line = one_error(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt, "-o", str(tmp_path / "out"),
                              "-q")[::2])
    assert "tensor 'model.layers.1.mlp.up_proj.weight' holds non-finite values" in line, line
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def odd_rows(tmp_path_factory, default_model) -> Path:
    """A Llama whose rows (hidden 96, intermediate 200) are not whole 256-value k-quant blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("odd") / "odd-rows"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=742,
                                 max_position_embeddings=512)).save_pretrained(out)
    for f in list(default_model.glob("tokenizer*")) + [default_model / "chat_template.jinja"]:
        shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("fmt, note", [
    ("gguf-q8_0", "note: 2 tensors written as F16 instead of Q8_0: rows of 200 values are not whole 32-value"),
    ("gguf-q4_k_m", "instead of Q4_K: rows of 96, 200 values are not whole 256-value Q4_K blocks"),
])
def test_kquant_fallbacks_are_noted(fmt, note, odd_rows, tmp_path, monkeypatch, capsys):
    if fmt != "gguf-q8_0":
        pytest.importorskip("llama_cpp")
    code, _, err = run_cli(monkeypatch, capsys, "convert", str(odd_rows), "-f", fmt, "-o", str(tmp_path / "out"), "-q")
    assert code == 0, err
    assert note in err, err
    assert "error" not in err


@pytest.mark.parametrize("config, want", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, not 0"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive integer, not -5"),
    ({"hidden_size": "256"}, "hidden_size must be a positive integer, not '256'"),
])
def test_config_sizes_that_crash_are_named(config, want, default_model, tmp_path, monkeypatch, capsys):
    from quantserve.modeling import check_config
    from quantserve.training.loading import check_model

    src = edited_copy(default_model, tmp_path / "src", config)
    for fmt in ("gguf-q8_0", "bnb-int8"):
        line = one_error(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt, "-o", str(tmp_path / fmt),
                                  "-q")[::2])
        assert f"{src / 'config.json'}: {want}" in line, line
    with pytest.raises(UserError, match=want):  # train and generate
        check_model(src)
    with pytest.raises(UserError, match="expected a JSON object, not list"):  # what `plan` reads raw
        check_config([1, 2], "config.json")


def test_plan_and_info_name_the_config_field(default_model, tmp_path):
    """`plan --model` and `info` read configs too: a zero head count and a list config were a
    ZeroDivisionError and a TypeError there."""
    from tests.support.cli import assert_one_line_error, cli

    src = edited_copy(default_model, tmp_path / "src", {"num_attention_heads": 0})
    (tmp_path / "list.json").write_text("[1, 2]")
    want = "num_attention_heads must be a positive integer, not 0"
    assert_one_line_error(cli("plan", "--model", str(src), "--seq-len", "512"), 1, want)
    assert_one_line_error(cli("info", str(src)), 1, want)
    assert_one_line_error(cli("plan", "--model", str(tmp_path / "list.json"), "--seq-len", "512"), 1,
                          "expected a JSON object, not list")


def test_checkpoints_transformers_loads_by_renaming_pass(tmp_path):
    """No false refusals: GPT-2 saved from its base model (names without "transformer.", which
    transformers prefixes at load) and a Mixtral (its experts' tensors are fused as they load, so
    the headers are not compared name by name; the load's own report checks them)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model, MixtralConfig

    from quantserve.modeling import check_weights_match

    base = tmp_path / "gpt2-base"
    GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    check_weights_match(base)
    moe = tmp_path / "mixtral"
    AutoModelForCausalLM.from_config(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                                   num_local_experts=2)).save_pretrained(moe)
    check_weights_match(moe)
    # and a GPT-2 base checkpoint with a tensor gone is still refused
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    weights.pop("h.0.mlp.c_fc.weight")
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="missing: transformer.h.0.mlp.c_fc.weight"):
        check_weights_match(base)
