"""Bad inputs to `generate`, `default-model`, `data`, `eval`, `bench serve` and `pipeline`: one
clear line and a non-zero exit, found before any model loads or any stage runs."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.cli import assert_one_line_error, cli


@pytest.fixture
def truncated_model(tmp_path, default_model):
    folder = tmp_path / "truncated"
    shutil.copytree(default_model, folder)
    weights = folder / "model.safetensors"
    with weights.open("r+b") as f:  # a copy cut short
        f.truncate(weights.stat().st_size // 2)
    return folder


def test_generate_refuses_a_prompt_past_the_context(default_model):
    context = json.loads((default_model / "config.json").read_text())["max_position_embeddings"]
    assert_one_line_error(cli("generate", "a " * (context + 100)), 1, f"maximum context length is {context}")
    assert_one_line_error(cli("generate", "hi", "--max-tokens", str(context)), 1, "--max-tokens")


def test_generate_refuses_a_prompt_that_is_not_utf8():
    # bytes that are not UTF-8 come from a shell's $'\xff\xfe'; Python sees them as surrogates
    proc = subprocess.run([sys.executable, "-m", "quantserve", "generate", b"\xff\xfe"], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert_one_line_error(proc, 2, "not valid UTF-8")


def test_generate_and_pipeline_name_a_truncated_safetensors(truncated_model, tmp_path):
    assert_one_line_error(cli("generate", "hi", "--model", str(truncated_model)), 1, "model.safetensors", "truncated")
    out = tmp_path / "run"
    assert_one_line_error(cli("pipeline", "--no-serve", "--model", str(truncated_model), "--out", str(out),
                              timeout=60), 1,
                          "model.safetensors", "truncated")
    assert not out.exists()


def test_default_model_prints_only_the_path_on_stdout(default_model):
    proc = cli("default-model", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{default_model}\n"
    assert "params" in proc.stderr  # the description is still shown


def test_data_refuses_an_empty_out(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantserve", "data", "--out", ""], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert_one_line_error(proc, 2, "--out is empty")
    assert list(tmp_path.iterdir()) == []


def test_eval_names_the_line_of_an_empty_conversation(tmp_path):
    text = tmp_path / "held.jsonl"
    text.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": []}\n')
    assert_one_line_error(cli("eval", "default", str(tmp_path / "none"), "--text", str(text)), 1,
                          f"{text}:2", "non-empty list")


def test_eval_reads_text_from_a_pipe(tmp_path):
    """`--text <(cmd)`: a pipe is read once; eval checks the file first, then scores it."""
    q8 = tmp_path / "q8"
    assert cli("convert", "default", "-f", "gguf-q8_0", "-o", str(q8)).returncode == 0
    proc = subprocess.run(["bash", "-c", f'"{sys.executable}" -m quantserve eval default {q8} '
                           "--text <(echo 'The quick brown fox jumps over the lazy dog.') --json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["text"].startswith("/dev/fd/")


def test_bench_serve_names_a_corpus_that_is_not_utf8(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"\xff\xfe abc\n")
    assert_one_line_error(cli("bench", "serve", "--corpus", str(corpus)), 1, str(corpus), "not UTF-8")


@pytest.mark.parametrize("args, needle", [
    (["--serve-format", "foo"], "--serve-format"),
    (["--formats", "gguf-q8_0,gguf-q8_0"], "more than once"),
])
def test_pipeline_options_are_checked_before_any_work(tmp_path, args, needle):
    out = tmp_path / "run"
    # timeout: before these checks the pipeline went on to train
    assert_one_line_error(cli("pipeline", "--no-serve", "--out", str(out), *args, timeout=60), 2, needle)
    assert not out.exists()


@pytest.mark.parametrize("record, needle", [
    ({"prompt": "x", "answer": "y"}, "'text' or a 'messages'"),
    ({"messages": [{"role": "assistant", "content": "y"}, {"role": "user", "content": "x"}]}, "first message"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "y"}]}, "user message"),
])
def test_pipeline_eval_data_is_checked_before_any_work(tmp_path, record, needle):
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps(record) + "\n")
    out = tmp_path / "run"
    assert_one_line_error(cli("pipeline", "--no-serve", "--eval-data", str(data), "--out", str(out), timeout=60), 1,
                          str(data), "line 1", needle)
    assert not out.exists()
