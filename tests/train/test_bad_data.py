"""Bad training data and options for `train`: one line naming the file, the line and what is wrong,
before the model loads (records with nothing to train on are bad lines --skip-bad-lines skips)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantserve.capabilities import Capabilities, check_dtype
from quantserve.settings import UserError
from quantserve.training.data import read_jsonl
from tests.support import REPO
from tests.support.cli import assert_one_line_error

CHAT = {"messages": [{"role": "user", "content": "Reverse: [a,b,c,d]"}, {"role": "assistant", "content": "[d,c,b,a]"}]}
ASSISTANT_FIRST = {"messages": [{"role": "assistant", "content": "y"}]}
BOTH = {"text": "hello", **CHAT}


def train(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "quantserve", "train", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env={**os.environ, "QUANTSERVE_DEBUG": ""})


def jsonl(path: Path, *records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("record, needle", [(ASSISTANT_FIRST, "the first message is the assistant's"),
                                            (BOTH, "both 'text' and 'messages'")])
def test_a_record_with_nothing_to_train_on_is_a_bad_line(tmp_path, record, needle):
    data = jsonl(tmp_path / "d.jsonl", CHAT, record)
    with pytest.raises(UserError, match=f"line 2: {needle}"):
        read_jsonl(data)
    assert [r.line for r in read_jsonl(data, skip_bad_lines=True)] == [1]  # --skip-bad-lines skips it


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_train_names_an_assistant_first_record(tmp_path, flag):
    good = jsonl(tmp_path / "good.jsonl", CHAT)
    bad = jsonl(tmp_path / "bad.jsonl", ASSISTANT_FIRST)
    files = {"--data": good, "--eval-data": None, flag: bad}
    args = [a for k, v in files.items() if v is not None for a in (k, str(v))]
    assert_one_line_error(train(*args, "--out", str(tmp_path / "o")), 1, str(bad), "line 1", "first message")
    assert not (tmp_path / "o").exists()


def test_seed_out_of_range_is_refused_up_front(tmp_path):
    good = jsonl(tmp_path / "good.jsonl", CHAT)
    assert_one_line_error(train("--data", str(good), "--out", str(tmp_path / "o"), "--seed", "-1"), 2, "--seed")
    assert not (tmp_path / "o").exists()


def test_t4_profile_refuses_bf16_on_a_cpu_too():
    cpu_t4 = Capabilities(torch_version="2", cuda_version=None, device="cpu", gpu_name=None, compute_capability=None,
                          gpu_memory_gib=None, profile="t4", dtype="float32", attention="sdpa",
                          sdpa_kernels=["math"], liger=False)
    with pytest.raises(UserError, match="bf16 is not supported under GPU profile 't4'"):
        check_dtype(cpu_t4, "bfloat16")


def test_a_full_fine_tune_of_a_quantized_model_is_refused_before_the_output(tmp_path, default_model):
    quantized = tmp_path / "int8"  # what `convert -f bnb-int8` writes, as far as the check reads
    shutil.copytree(default_model, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    good = jsonl(tmp_path / "good.jsonl", CHAT)
    out = tmp_path / "o"
    assert_one_line_error(train("--data", str(good), "--out", str(out), "--model", str(quantized)), 1,
                          "is quantized", "--method lora or qlora")
    assert not out.exists()


def test_train_reads_its_data_from_a_pipe(tmp_path):
    good = jsonl(tmp_path / "good.jsonl", CHAT, CHAT)
    out = tmp_path / "o"
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" -m quantserve train --data <(cat {good}) '
                           f"--out {out} --max-steps 1 --quiet"], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "train_log.json").is_file()


def test_a_malformed_hostfile_is_named_with_its_line(tmp_path):
    good = jsonl(tmp_path / "good.jsonl", CHAT)
    hosts = tmp_path / "hosts"
    hosts.write_text("# workers\n\nnode1 slots=2\nnode2 slots two\n")
    assert_one_line_error(train("--data", str(good), "--out", str(tmp_path / "o"), "--hostfile", str(hosts)), 1,
                          f"{hosts}:4", "hostname slots=N")


def test_deepspeed_is_found_beside_this_python(monkeypatch):
    from quantserve.training.distributed import deepspeed_launcher

    beside = Path(sys.executable).parent / "deepspeed"
    if not beside.is_file():
        pytest.skip("deepspeed is not installed beside this Python")
    monkeypatch.setenv("PATH", "/nonexistent")  # a virtualenv run by its path, never activated
    assert deepspeed_launcher() == str(beside)
