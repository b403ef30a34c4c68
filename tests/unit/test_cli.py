"""The `quantserve` command line: fast help, `info`, and one clear line for every bad input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.cli import assert_one_line_error, cli, ctrl_c
from tests.support.odd_models import odd_models


def test_help_is_fast_and_imports_no_heavy_library():
    code = ("import sys, time; t=time.time(); from quantserve.cli import app; "
            "import typer.main; typer.main.get_command(app); "
            "heavy=[m for m in ('torch','transformers','deepspeed','llama_cpp','bitsandbytes') if m in sys.modules]; "
            "print(time.time()-t, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout.split(" ", 1)
    # no heavy library is what keeps --help instant (~0.3 s here); the times only guard against a
    # gross regression, with room for a cold, busy CI machine
    assert out[1].strip() == "[]" and float(out[0]) < 3.0, out
    t = time.time()
    proc = cli("--help")
    assert proc.returncode == 0 and "info" in proc.stdout
    assert time.time() - t < 15  # includes interpreter start-up


def test_unknown_subcommand_and_option():
    assert_one_line_error(cli("frobnicate"), 2, "frobnicate")
    assert_one_line_error(cli("info", "--no-such-flag"), 2, "--no-such-flag")


def test_info_json_reports_the_environment():
    proc = cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    import torch

    assert info["torch_version"] == torch.__version__
    assert info["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert info["profile"] == "native"
    assert info["attention"] in ("flash_attention_2", "sdpa", "eager")
    assert set(info["packages"]) >= {"liger_kernel", "bitsandbytes", "deepspeed", "llama_cpp"}
    if info["device"] == "cpu":
        assert info["dtype"] == "float32" and info["liger"] is False


def test_info_table_and_t4_profile():
    proc = cli("info", "--gpu-profile", "t4")
    assert proc.returncode == 0 and "t4" in proc.stdout and "attention" in proc.stdout
    assert_one_line_error(cli("info", "--gpu-profile", "a100"), 2, "unknown GPU profile")
    assert_one_line_error(cli("info", env={"QUANTSERVE_GPU_PROFILE": "h100"}), 1, "unknown GPU profile")


def test_model_that_is_not_a_checkpoint(tmp_path):
    assert_one_line_error(cli("generate", "hi", "--model", str(tmp_path / "missing")), 1, "no such file")
    assert_one_line_error(cli("generate", "hi", "--model", str(tmp_path)), 1, "no config.json")
    (tmp_path / "config.json").write_text("{}")
    assert_one_line_error(cli("generate", "hi", "--model", str(tmp_path)), 1, "no weight files")
    f = tmp_path / "weights.safetensors"
    f.write_text("junk")
    assert_one_line_error(cli("generate", "hi", "--model", str(f)), 1, "not a checkpoint folder")


def test_unwritable_cache_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = cli("default-model", "--rebuild", "--quiet", env={"QUANTSERVE_HOME": str(blocker / "cache")})
    assert_one_line_error(proc, 1, "cannot create cache folder")


def test_generate_from_the_default_model(default_model):
    proc = cli("generate", "What is the capital of Norvania?", "--model", str(default_model))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Velmor"


def test_bench_commands_refuse_bad_input_in_one_line(tmp_path):
    """Arguments are checked before a model is built or a server is asked; a failed run exits
    non-zero through `quantserve bench` too (the wrapper once turned every exit code into 0)."""
    unreachable = "http://127.0.0.1:9/v1"  # port 9 (discard): nothing listens there
    assert_one_line_error(cli("bench", "serve", "--base-url", unreachable), 1, "cannot reach")
    assert_one_line_error(cli("bench", "serve", "--concurrency", "1,x"), 2, "--concurrency", "'x'")
    assert_one_line_error(cli("bench", "serve", "--concurrency", "0"), 2, "at least 1")
    assert_one_line_error(cli("bench", "serve", "--corpus", str(tmp_path / "none.txt")), 2, "no such file")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_one_line_error(cli("bench", "serve", "--base-url", unreachable, "--corpus", str(empty)), 1, "no lines")
    assert_one_line_error(cli("bench", "serve", "--base-url", unreachable, "--out", str(empty / "x.json")), 1, "--out")
    for timeout in ("0", "-1", "nan"):
        assert_one_line_error(cli("bench", "serve", "--timeout", timeout), 2, "seconds")
    assert_one_line_error(cli("bench", "decode", "--models", "70b"), 2, "--models", "choose from")
    assert_one_line_error(cli("bench", "decode", "--quants", "int8,int3"), 2, "'int3'")
    not_a_result = tmp_path / "other.json"
    not_a_result.write_text('{"rows": []}')
    assert_one_line_error(cli("bench", "plot", str(not_a_result)), 1, "not a `bench serve` result")
    assert_one_line_error(cli("bench", "plot", str(tmp_path / "missing.json")), 2, "no such file")


@pytest.mark.parametrize("args", [
    ("serve", "default", "--engine", "bogus"), ("serve", "default", "--weight-quant", "int3"),
    ("serve", "default", "--log-level", "loud"), ("serve", "default", "--max-queue", "0"),
    ("serve", "default", "--gpu-profile", "a100"),
    # empty values (an unset shell variable) never mean "every address" or "no key"
    ("serve", "default", "--host", ""), ("serve", "default", "--api-key", ""),
    ("serve", "default", "--served-model-name", " "), ("serve", "default", "--shutdown-grace", "inf"),
    ("train", "--data", "x.jsonl", "--out", "o", "--method", "dora"),
    ("train", "--data", "x.jsonl", "--out", "o", "--lr", "inf"), ("train", "--data", "x.jsonl", "--out", "o", "--lr", "nan"),
    ("train", "--data", "x.jsonl", "--out", "o", "--epochs", "nan"),
    ("train", "--data", "x.jsonl", "--out", "o", "--warmup-ratio", "-1"),
    ("train", "--data", "x.jsonl", "--out", "o", "--micro-batch", "0"),
    ("train", "--data", "x.jsonl", "--out", "o", "--nproc", "0"),
    ("convert", "default", "-f", "bogus", "-o", "o"), ("pipeline", "--formats", "gguf-q3_xs", "--no-serve"),
    ("plan", "--seq-len", "128", "--gpu", "tpu"), ("plan", "--seq-len", "128", "--gpu-mem", "nan"),
    ("plan", "--seq-len", "0", "--gpu-mem", "8"),
])
def test_a_value_an_option_cannot_take_exits_2(args):
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [(), ("bench",)])
def test_an_empty_command_line_prints_the_help(args):
    proc = cli(*args)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: quantserve") and "Commands:" in proc.stdout


def test_version_is_printed_by_both_commands():
    from importlib.metadata import version

    assert cli("--version").stdout.strip() == f"quantserve {version('quantserve')}"
    proc = subprocess.run([str(Path(sys.executable).parent / "quant"), "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"quantserve {version('quantserve')}"


def test_quant_alone_prints_its_help():
    proc = subprocess.run([str(Path(sys.executable).parent / "quant")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: quant") and "convert" in proc.stdout


def test_a_busy_port_is_refused_before_the_model_loads():
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = cli("serve", "default", "--port", str(port))
        assert_one_line_error(proc, 1, "port in use")
        assert "loaded" not in proc.stdout + proc.stderr and time.monotonic() - t0 < 30
        proc = cli("pipeline", "--out", "/nonexistent/never-written", "--port", str(port))
        assert_one_line_error(proc, 1, "in use")


def test_data_never_replaces_files_without_force(tmp_path):
    out = tmp_path / "d"
    assert cli("data", "--out", str(out)).returncode == 0
    (out / "task_train.jsonl").write_text("mine\n")
    assert_one_line_error(cli("data", "--out", str(out)), 1, "already exists", "--force")
    assert (out / "task_train.jsonl").read_text() == "mine\n"
    assert cli("data", "--out", str(out), "--force").returncode == 0
    assert (out / "task_train.jsonl").read_text() != "mine\n"


def test_an_unexpected_error_shows_its_whole_reason_on_one_line(tmp_path, default_model):
    """A library error whose first line only announces the reason (transformers' config
    validation) still says it: the lines are joined into the one error line."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(default_model, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": -1}))
    proc = cli("info", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "hidden_size" in line or "-1" in line, line


@pytest.mark.parametrize("engine, name, value", [("hf", "QUANTSERVE_OFF_LOOP_CHARS", "-5"),
                                                 ("fast", "QUANTSERVE_FUSED_DECODE", "bogus")])
def test_a_bad_environment_variable_is_named_never_ignored(engine, name, value):
    proc = cli("serve", "default", "--engine", engine, "--port", "0", env={name: value}, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{name}={value!r}" in errors[0] and "hf engine" not in errors[0], proc.stderr


def test_generate_refuses_a_model_that_is_not_a_causal_lm(tmp_path, default_model):
    """quant's check, before loading: not a page of transformers' load report, then a chat-template error."""
    bert = odd_models(tmp_path, default_model) / "bert"
    assert_one_line_error(cli("generate", "hi", "--model", str(bert)), 1, "BertModel", "not a causal language model")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Typer turned a KeyboardInterrupt into a silent exit 130: Ctrl-C printed nothing at all."""
    # decoding far more tokens than --quick's: still running when the signal comes, however loaded the machine
    code, _, err = ctrl_c("bench", "decode", "--quick", "--new-tokens", "1000000", "--out", str(tmp_path / "decode.json"),
                          after="copy bandwidth")
    assert code == 130 and err == "error: interrupted\n", (code, err)


def test_ctrl_c_in_train_is_its_own_resume_hint_alone(tmp_path):
    """`train` says where a rerun resumes: that line is the one line, with no "interrupted" added."""
    assert cli("data", "--out", str(tmp_path / "data")).returncode == 0
    code, _, err = ctrl_c("train", "--data", str(tmp_path / "data" / "task_train.jsonl"), "--out", str(tmp_path / "run"),
                          after="model:", stream="stderr")
    assert code == 130 and "Traceback" not in err, (code, err)
    said = [line for line in err.splitlines() if "interrupted" in line]
    assert said == ["interrupted: no checkpoint was saved yet; the same command starts again"], err
