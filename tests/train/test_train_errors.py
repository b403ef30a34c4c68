"""Bad requests end in one clear line and a non-zero exit, before any model or GPU memory exists."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantserve.capabilities import Capabilities
from quantserve.settings import UserError
from quantserve.training.config import TrainConfig
from tests.support.odd_models import odd_models as make_odd_models

CHAT = json.dumps({"messages": [{"role": "user", "content": "Reverse: [a,b,c,d]"},
                                {"role": "assistant", "content": "[d,c,b,a]"}]})


def cli(*args, cwd=None):
    env = dict(os.environ, QUANTSERVE_DEBUG="")
    return subprocess.run([sys.executable, "-m", "quantserve", "train", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.jsonl"
    p.write_text(CHAT + "\n")
    return p


def one_line_error(r, *needles):
    assert r.returncode != 0, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_malformed_jsonl_names_lines(tmp_path, default_model):
    p = tmp_path / "bad.jsonl"
    p.write_text(CHAT + "\n{oops\n" + CHAT + "\n")
    one_line_error(cli("--data", str(p), "--out", str(tmp_path / "o")), "line 2", "--skip-bad-lines")
    assert not (tmp_path / "o").exists()


def test_impossible_setup_via_cli(good, tmp_path):
    one_line_error(cli("--data", str(good), "--out", str(tmp_path / "o"), "--method", "qlora", "--zero", "3"),
                   "QLoRA does not combine with ZeRO-3")


@pytest.mark.parametrize("setting, said", [
    ({"padding_free": "yes"}, '"padding_free" must be true or false, not "yes"'),
    ({"micro_batch": 2.5}, '"micro_batch" must be an integer, not 2.5'),
    ({"micro_batch": True}, '"micro_batch" must be an integer, not true'),
    ({"lr": "1e-3"}, '"lr" must be a number, not "1e-3"'),
    ({"zero": "2"}, '"zero" must be an integer, not "2"'),
    ({"eval_data": 3}, '"eval_data" must be a path (a string), not 3'),
])
def test_a_config_files_value_of_the_wrong_type_is_refused(setting, said, good, tmp_path):
    """JSON has its own types: a "yes" where a bool belongs must not be taken as true."""
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"data": str(good), "out": str(tmp_path / "o"), **setting}))
    with pytest.raises(UserError) as e:
        TrainConfig.from_file(path)
    assert str(e.value) == f"{path}: {said}"


def test_a_config_file_may_give_null_for_an_optional_setting_and_an_integer_for_a_number(good, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"data": str(good), "out": "o", "zero": None, "lr": 1, "padding_free": False}))
    cfg = TrainConfig.from_file(path)
    assert cfg.zero is None and cfg.lr == 1 and cfg.padding_free is False


def train_error(cfg: TrainConfig) -> str:
    """train() must refuse `cfg` with a UserError before creating the output folder."""
    from quantserve.training.train import train

    with pytest.raises(UserError) as e:
        train(cfg)
    assert not cfg.out.exists()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_empty_data(tmp_path, default_model):
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert "no training records" in train_error(TrainConfig(data=p, out=tmp_path / "o"))


def test_missing_data(tmp_path):
    assert "no such data file" in train_error(TrainConfig(data=tmp_path / "nope.jsonl", out=tmp_path / "o"))


def test_seq_len_over_model_limit(good, tmp_path, default_model):
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", seq_len=100000))
    assert "over the model's limit" in msg


@pytest.mark.parametrize("kw, needle", [
    (dict(method="qlora", zero=3), "QLoRA does not combine with ZeRO-3"),
    (dict(offload="optimizer"), "--offload needs DeepSpeed"),
    (dict(zero=2, offload="all"), "needs --zero 3"),
    (dict(zero=5), "--zero must be 0, 1, 2 or 3"),
    (dict(method="full", merge=True), "--merge applies to"),
    (dict(micro_batch=4, global_batch=6), "--global-batch 6 is not a multiple"),
    (dict(dtype="fp16"), "fp16 training needs a CUDA GPU"),
    (dict(attn="flash2"), "--attn flash2 cannot run here"),
    (dict(method="dora"), "--method must be one of"),
    (dict(plan="auto"), "this run has no GPU"),
    (dict(stop_at_exact_match=0.9), "--stop-at-exact-match needs --eval-data"),
    (dict(eval_data=Path("/nonexistent.jsonl")), "no such eval data file"),
    (dict(lr_schedule="cyclic"), "--lr-schedule must be one of"),
    (dict(eval_steps=0), "--eval-steps must be at least 1"),
])
def test_impossible_setups(good, tmp_path, default_model, kw, needle):
    if kw.get("dtype") == "fp16" or kw.get("attn") == "flash2" or kw.get("plan"):
        from quantserve.capabilities import detect

        if detect().device != "cpu":
            pytest.skip("checks what a CPU-only host refuses")
    assert needle in train_error(TrainConfig(data=good, out=tmp_path / "o", **kw))


def test_eval_data_must_end_in_an_answer(good, tmp_path, default_model):
    p = tmp_path / "eval.jsonl"
    p.write_text(json.dumps({"text": "no answer to score"}) + "\n")
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", eval_data=p, stop_at_exact_match=0.5))
    assert "eval record needs 'messages'" in msg and "line 1" in msg
    assert "a fraction in (0, 1]" in train_error(TrainConfig(data=good, out=tmp_path / "o", eval_data=good,
                                                             stop_at_exact_match=1.5))
    assert "ZeRO-3" in train_error(TrainConfig(data=good, out=tmp_path / "o", eval_data=good, zero=3))


def t4(**kw) -> Capabilities:
    """What `detect()` returns on a T4 (or under the T4 profile)."""
    base = dict(torch_version="2", cuda_version="12", device="cuda", gpu_name="Tesla T4",
                compute_capability=(7, 5), gpu_memory_gib=15.0, profile="native", dtype="float16",
                attention="sdpa", sdpa_kernels=["efficient", "math"], liger=False,
                packages={"bitsandbytes": "0.50", "deepspeed": "0.19", "flash_attn": None, "liger_kernel": None})
    return Capabilities(**{**base, **kw})


def test_bf16_on_a_t4_is_refused(good, tmp_path):
    from transformers import LlamaConfig

    from quantserve.training.train import resolve

    cfg = TrainConfig(data=good, out=tmp_path / "o", dtype="bf16")
    with pytest.raises(UserError, match="bf16 is not supported on Tesla T4"):
        resolve(cfg, t4(), LlamaConfig())
    cfg = TrainConfig(data=good, out=tmp_path / "o", attn="flash2")
    with pytest.raises(UserError, match="flash-attn is not installed"):
        resolve(cfg, t4(), LlamaConfig())
    # auto on a T4: fp16 and SDPA; Liger reported off with its reason
    res = resolve(TrainConfig(data=good, out=tmp_path / "o"), t4(), LlamaConfig())
    assert (res.dtype, res.attention, res.liger) == ("float16", "sdpa", False)
    assert "not installed" in res.liger_reason


def test_liger_on_cpu_falls_back_and_says_so(good, tmp_path):
    from transformers import LlamaConfig

    from quantserve.capabilities import detect
    from quantserve.training.train import resolve

    caps = detect()
    if caps.device != "cpu":
        pytest.skip("checks the CPU fallback; on a GPU Liger may really be on")
    res = resolve(TrainConfig(data=good, out=tmp_path / "o", liger=True), caps, LlamaConfig())
    assert res.liger is False and res.notes and "training without it" in res.notes[0]


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                    reason="liger-kernel (Triton) is not installed: CPU-only installs leave it out")
def test_liger_module_patches_are_undone_after_training():
    """Liger rebinds names in modeling_llama (and F.cross_entropy for its plain loss); after a
    fine-tune those must be back, or a model loaded later on the CPU runs Triton kernels and fails."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from quantserve.training.loading import apply_liger, undo_liger_globals

    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    before = [getattr(modeling_llama, n) for n in names] + [F.cross_entropy]
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    apply_liger(LlamaForCausalLM(cfg), zero=3)  # ZeRO-3: Liger's plain cross-entropy, patched into torch
    assert [getattr(modeling_llama, n) for n in names] + [F.cross_entropy] != before
    undo_liger_globals()
    assert [getattr(modeling_llama, n) for n in names] + [F.cross_entropy] == before
    ids = torch.randint(0, 128, (1, 8))
    assert torch.isfinite(LlamaForCausalLM(cfg)(input_ids=ids, labels=ids).loss)  # plain torch, on the CPU


def test_a_run_never_writes_over_its_base_model_or_a_folder_of_other_files(tmp_path, default_model, good):
    """--out the base model's own folder (or one holding it) is refused even with --force; a folder
    of other files (no run.json) is refused without --force, and nothing in either is touched."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(default_model, base)
    before = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    (tmp_path / "run").mkdir()
    shutil.copytree(default_model, tmp_path / "run" / "checkpoint-5")  # a run's own checkpoint as the base
    for model, out in ((base, base), (tmp_path / "run" / "checkpoint-5", tmp_path / "run")):
        one_line_error(cli("--data", str(good), "--model", str(model), "--out", str(out), "--force"), "base model")
    theirs = tmp_path / "notes"
    theirs.mkdir()
    (theirs / "thesis.txt").write_text("mine")
    one_line_error(cli("--data", str(good), "--model", str(base), "--out", str(theirs)), "--force", "run.json")
    assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == before
    assert [p.name for p in theirs.iterdir()] == ["thesis.txt"]


# Options that only another method or feature reads would do nothing: refused, never ignored.
@pytest.mark.parametrize("args, said", [
    (["--lora-r", "8", "--lora-alpha", "4", "--lora-targets", "q_proj"],
     "--lora-r, --lora-alpha, --lora-targets apply to --method lora/qlora only"),
    (["--lora-r", "16"], "--lora-r applies to --method lora/qlora only"),  # the default value, given
    (["--no-merge"], "--merge applies to --method lora/qlora only"),
    (["--eval-steps", "5"], "--eval-steps needs --eval-data"),
    (["--packing", "--padding-free"], "--padding-free / --padded lay out unpacked batches"),  # the default, given
    (["--packing", "--padded"], "--padding-free / --padded lay out unpacked batches"),
])
def test_an_option_that_would_do_nothing_is_refused(args, said, good, tmp_path):
    one_line_error(cli("--data", str(good), "--out", str(tmp_path / "o"), "--max-steps", "1", *args), said)
    assert not (tmp_path / "o").exists()


def test_a_config_files_lora_settings_for_a_full_fine_tune_are_refused(good, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"data": str(good), "out": str(tmp_path / "o"), "lora_targets": "q_proj"}))
    with pytest.raises(UserError, match="--lora-targets applies to --method lora/qlora only"):
        TrainConfig.from_file(path).validate()
    TrainConfig.from_file(path, method="lora").validate()


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory, default_model):
    return make_odd_models(tmp_path_factory.mktemp("odd-models"), default_model)


@pytest.mark.parametrize("name", ["bert", "t5"])
def test_a_model_that_is_not_a_causal_lm_is_refused_first(name, odd_models, good, tmp_path):
    """Said before the data is read: the BERT otherwise fails on its tokenizer's chat template."""
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", model=str(odd_models / name)))
    assert "not a causal language model" in msg and str(odd_models / name) in msg


def test_truncated_weights_name_the_file(odd_models, good, tmp_path):
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", model=str(odd_models / "trunc")))
    assert f"{odd_models / 'trunc' / 'model.safetensors'}: safetensors file is truncated" in msg


def test_a_lora_target_that_matches_nothing_is_named_with_the_choices(good, tmp_path, default_model):
    """Also when another target matches: peft would then leave the unmatched one out silently."""
    for targets in ("nonexistent_proj", "q_proj,nonexistent_proj"):
        msg = train_error(TrainConfig(data=good, out=tmp_path / "o", method="lora", lora_targets=targets))
        assert "'nonexistent_proj' matches no linear layer" in msg
        assert "q_proj" in msg and "down_proj" in msg and "all-linear" in msg


def test_eval_data_problems_say_evaluation(good, tmp_path, default_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", eval_data=empty))
    assert msg.startswith(f"{empty}: no evaluation records"), msg
    bad = tmp_path / "bad.jsonl"
    bad.write_text(CHAT + "\n{oops\n")
    msg = train_error(TrainConfig(data=good, out=tmp_path / "o", eval_data=bad))
    assert "line 2" in msg and "--skip-bad-lines" not in msg  # it covers --data only


def test_an_output_folder_that_cannot_be_made_is_refused_up_front(good, tmp_path):
    """By validate(), which loads nothing (before: after the model had loaded)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="afile is a file, not a folder"):
        TrainConfig(data=good, out=tmp_path / "afile" / "o").validate()
    if Path("/proc/self").is_dir():  # refuses a new folder even to root, whose permission bits pass
        with pytest.raises(UserError, match="--out /proc/x: cannot create a folder in /proc"):
            TrainConfig(data=good, out=Path("/proc/x")).validate()
    TrainConfig(data=good, out=tmp_path / "new" / "o").validate()
    assert not (tmp_path / "new").exists()  # the check leaves nothing behind


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_stdout_carries_only_the_output_path_under_deepspeed(good, tmp_path, default_model):
    """DeepSpeed prints "... built successfully" on stdout when it builds its CPU communication op."""
    out = tmp_path / "o"
    r = cli("--data", str(good), "--out", str(out), "--max-steps", "1", "--micro-batch", "1", "--zero", "2",
            "--method", "lora", "--save-steps", "0", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{out}\n"


@pytest.mark.parametrize("name, said", [
    ("t5", "T5Config is an encoder-decoder model (T5ForConditionalGeneration) and has no intermediate_size"),
    ("bert", "BertConfig describes a BertModel, not a causal LM"),
])
def test_plan_refuses_what_its_arithmetic_does_not_describe(name, said, odd_models):
    from quantserve.training.plan import plan

    with pytest.raises(UserError) as e:
        plan(model=str(odd_models / name), seq_len=512)
    assert said in str(e.value) and "decoder-only causal LM" in str(e.value) and "\n" not in str(e.value)
