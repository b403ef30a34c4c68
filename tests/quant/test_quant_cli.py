"""quant's command line: convert / inspect / eval through the real entry point, and bad input —
broken checkpoints, a killed conversion, full and read-only disks — as one clear line and a
non-zero exit, never a traceback or a folder that looks finished.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantserve.formats import CONVERT_FORMATS as FORMATS
from quantserve.quant.convert import convert
from tests.support.cli import quant_cli as run_cli


# --- the CLI and bad input ---------------------------------------------------------------------

def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_cli_convert_inspect_eval(default_model, tmp_path, monkeypatch, capsys, small_heldout):
    out = tmp_path / "q8"
    code, stdout, _ = run_cli(monkeypatch, capsys, "convert", str(default_model), "--format", "gguf-q8_0",
                              "--out", str(out), "--quiet")
    assert code == 0 and "serving needs" in stdout
    code, stdout, _ = run_cli(monkeypatch, capsys, "inspect", str(out / "model.gguf"))
    assert code == 0 and "GGUF architecture llama, 39 tensors" in stdout and "tokenizer.ggml.pre = gpt-2" in stdout
    code, stdout, _ = run_cli(monkeypatch, capsys, "eval", str(default_model), str(out), "--text", str(small_heldout))
    assert code == 0 and "| gguf-q8_0 (llama.cpp) |" in stdout
    # refuses to overwrite without --force, and leaves the existing output intact
    before = (out / "model.gguf").stat().st_mtime_ns
    code, _, err = run_cli(monkeypatch, capsys, "convert", str(default_model), "-f", "gguf-f16", "-o", str(out), "-q")
    assert code == 1 and "already exists (use --force" in err
    assert (out / "model.gguf").stat().st_mtime_ns == before
    code, _, _ = run_cli(monkeypatch, capsys, "convert", str(default_model), "-f", "gguf-f16", "-o", str(out),
                         "-q", "--force")
    assert code == 0 and json.loads((out / "manifest.json").read_text())["format"] == "gguf-f16"
    assert leftovers(tmp_path) == ["q8"]  # no temporary or old folders left beside it
    # --force replaces an earlier conversion only: a folder of other files is never deleted
    theirs = tmp_path / "notes"
    theirs.mkdir()
    (theirs / "thesis.txt").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "convert", str(default_model), "-f", "gguf-f16", "-o", str(theirs),
                           "-q", "--force")
    assert code == 1 and "not an earlier conversion" in err and leftovers(theirs) == ["thesis.txt"]


def test_killed_conversion_leaves_nothing_that_looks_valid(default_model, tmp_path):
    """A conversion killed outright (SIGKILL: no cleanup runs) leaves only a hidden partial
    folder, never OUT itself; the next conversion removes it."""
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "quant"), "convert", str(default_model),
                             "-f", "gguf-q4_k_m", "-o", str(out), "-q"])
    partial = tmp_path / f".out.partial-{proc.pid}"
    deadline = time.time() + 60
    while not partial.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial.exists(), "the conversion was not killed mid-way: the test proved nothing"
    assert not out.exists(), "a killed conversion left a folder that looks like a finished output"
    convert(default_model, "gguf-f16", out, progress=False)
    assert leftovers(tmp_path) == ["out"] and (out / "manifest.json").is_file()


def corrupt_copies(default_model: Path, root: Path) -> dict[str, Path]:
    """Checkpoint folders broken in one way each."""
    def copy(name):
        dst = root / name
        shutil.copytree(default_model, dst)
        return dst

    bad = {"not a checkpoint": root / "empty"}
    bad["not a checkpoint"].mkdir(parents=True)
    gpt2 = copy("gpt2")
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    bad["unsupported architecture"] = gpt2
    alien = copy("alien")
    (alien / "config.json").write_text(json.dumps({**cfg, "architectures": ["FrobnicatorForCausalLM"]}))
    bad["unknown architecture"] = alien
    trunc = copy("truncated")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    bad["truncated safetensors"] = trunc
    garbage = copy("garbage")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[24:])
    bad["corrupt safetensors"] = garbage
    return bad


@pytest.mark.parametrize("fmt", ["gguf-f16", "bnb-nf4"])
def test_bad_inputs_fail_clearly(fmt, default_model, tmp_path, monkeypatch, capsys):
    expected = {"not a checkpoint": "not a Hugging Face checkpoint",
                "unsupported architecture": "unsupported architecture GPT2LMHeadModel" if fmt.startswith("gguf")
                else None,
                "unknown architecture": "unsupported architecture FrobnicatorForCausalLM",
                "truncated safetensors": "safetensors file is truncated",
                "corrupt safetensors": "corrupt safetensors header"}
    for problem, src in corrupt_copies(default_model, tmp_path / "in").items():
        if expected[problem] is None:
            continue  # GPT-2 is a causal LM transformers can quantize with bitsandbytes
        out = tmp_path / "out" / problem.replace(" ", "_")
        code, stdout, err = run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt, "-o", str(out), "-q")
        assert code == 1, problem
        assert err.startswith("error: ") and expected[problem] in err, (problem, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert leftovers(tmp_path / "out") == [], problem
    code, _, err = run_cli(monkeypatch, capsys, "convert", str(default_model), "-f", "gguf-q3_14", "-o",
                           str(tmp_path / "out" / "x"))
    assert code == 2 and "unknown format 'gguf-q3_14'" in err and leftovers(tmp_path / "out") == []
    code, _, err = run_cli(monkeypatch, capsys, "convert", str(default_model), "-f", fmt, "-o",
                           str(tmp_path / "out" / "x"), "--context", "99999999999", "-q")
    assert code == 1 and "trained context of 512" in err and leftovers(tmp_path / "out") == []


def _unshare_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("disk", ["full", "fills up while writing", "read-only"])
def test_target_on_a_full_or_read_only_disk(disk, default_model, tmp_path):
    """Real failing disks: a small tmpfs or a read-only remount in a private mount namespace
    (`unshare -m`), and a file-size limit that makes the write itself fail half-way."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    quant = Path(sys.executable).parent / "quant"
    convert_cmd = f"{quant} convert {default_model} -f gguf-f16 -o {mnt}/out -q"
    if disk == "fills up while writing":  # ~7.5 MB of F16 against a 2 MiB file-size limit
        cmd, want = ["sh", "-c", f"ulimit -f 2048; {convert_cmd}; rc=$?; ls -A {mnt}; exit $rc"], "no space left"
    else:
        if not _unshare_works():
            pytest.skip("needs `unshare -m` and tmpfs mounts (root)")
        size, want = ("4m", "not enough disk space") if disk == "full" else ("64m", "read-only")
        remount = f"mount -o remount,ro {mnt} && " if disk == "read-only" else ""
        cmd = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && {remount}"
               f"{convert_cmd}; rc=$?; ls -A {mnt}; exit $rc"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], proc.stderr
    assert proc.stdout.strip() == "", f"left behind: {proc.stdout}"


def test_quant_formats_says_bits_and_engine_for_every_format():
    proc = subprocess.run([sys.executable, "-m", "quantserve", "convert", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    proc = subprocess.run([sys.executable, "-c", "from quantserve.quant.cli import main; main()", "formats", "--json"],
                          capture_output=True, text=True, timeout=60)
    rows = json.loads(proc.stdout)
    assert [r["format"] for r in rows] == list(FORMATS)
    assert all(r["engine"] in ("hf", "gguf") and 2 < r["bits_per_weight"] <= 32 and r["description"] for r in rows)


def test_a_piped_bnb_convert_prints_its_answer_and_no_library_noise(default_model, tmp_path):
    """A fresh `quant convert -f bnb-int8` process, piped: stdout is its one-line answer (DeepSpeed,
    imported through transformers, used to print "Setting accelerator to CPU" there), and stderr
    holds no warning our own settings cause (huggingface_hub's "Cannot enable progress bars", once
    a line per bnb convert) and no bar redrawn in place."""
    out = tmp_path / "bnb"
    proc = subprocess.run([str(Path(sys.executable).parent / "quant"), "convert", str(default_model), "-f", "bnb-int8",
                           "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and proc.stdout.startswith(f"{out}: bnb-int8"), proc.stdout
    assert "accelerator" not in proc.stdout + proc.stderr
    assert "Cannot enable progress bars" not in proc.stderr and "\r" not in proc.stderr, proc.stderr


# --- broken outputs, quantized sources, broken configs, missing tokenizers, bad --text -----------

BNB_INT8 = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}


def quantized_copy(default_model: Path, dst: Path, manifest: bool = True) -> Path:
    """The default model dressed as a bnb-int8 `quant convert` output (its config's
    quantization_config, and a manifest listing its weights): what inspect, eval and convert read
    before they load anything, without a real bitsandbytes conversion."""
    shutil.copytree(default_model, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": BNB_INT8}))
    if manifest:
        from quantserve.quant.manifest import build_manifest, write_manifest
        from quantserve.quant.source import open_checkpoint

        write_manifest(dst, build_manifest(ckpt=open_checkpoint(default_model), fmt="bnb-int8", out_dir=dst,
                                           weight_files=[dst / "model.safetensors"], summary={}, context=512,
                                           seconds=0))
    return dst


def one_error_line(code: int, err: str) -> str:
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (code, err)
    assert "Traceback (most recent" not in err and "Error:" not in err, err  # no library exception's name
    return err


def test_a_quant_output_with_broken_weights_is_not_reported_valid(default_model, tmp_path, monkeypatch, capsys):
    out = quantized_copy(default_model, tmp_path / "bnb")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: 1 << 20])  # a copy cut short
    for cmd in (["inspect", str(out)], ["eval", str(default_model), str(out)]):
        err = one_error_line(*run_cli(monkeypatch, capsys, *cmd)[::2])
        assert f"{weights}: safetensors file is truncated" in err, (cmd, err)
    weights.unlink()
    for cmd in (["inspect", str(out)], ["eval", str(default_model), str(out)]):
        err = one_error_line(*run_cli(monkeypatch, capsys, *cmd)[::2])
        assert "manifest.json names 'model.safetensors', which is not a file in it" in err, (cmd, err)


@pytest.mark.parametrize("manifest", [True, False], ids=["quant-output", "bnb-checkpoint"])
def test_an_already_quantized_source_is_refused_up_front(manifest, default_model, tmp_path, monkeypatch, capsys):
    src = quantized_copy(default_model, tmp_path / "bnb", manifest=manifest)
    for fmt in ("bnb-nf4", "gguf-q8_0"):
        err = one_error_line(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt, "-o",
                                      str(tmp_path / "out" / fmt), "-q")[::2])
        assert f"{src} is already quantized (bnb-int8): convert from the unquantized checkpoint" in err, err
    assert leftovers(tmp_path / "out") == []


@pytest.mark.parametrize("config, want", [("[1, 2]", "expected a JSON object"), ("{garbage", "not valid JSON")])
def test_a_broken_config_json_is_named(config, want, default_model, tmp_path, monkeypatch, capsys):
    from quantserve.quant.prequantized import quantization_problem
    from quantserve.settings import UserError

    src = tmp_path / "src"
    shutil.copytree(default_model, src)
    (src / "config.json").write_text(config)
    for fmt in ("gguf-f16", "bnb-int8"):
        err = one_error_line(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", fmt, "-o", str(tmp_path / fmt),
                                      "-q")[::2])
        assert f"{src / 'config.json'}: {want}" in err, err
    with pytest.raises(UserError, match=f"config.json: {want}"):  # what the serving engines ask too
        quantization_problem(src)


def test_a_checkpoint_without_tokenizer_files_is_refused_in_one_line(default_model, tmp_path, monkeypatch, capsys):
    src = tmp_path / "notok"
    shutil.copytree(default_model, src, ignore=shutil.ignore_patterns("tokenizer*"))
    err = one_error_line(*run_cli(monkeypatch, capsys, "convert", str(src), "-f", "bnb-int8", "-o",
                                  str(tmp_path / "out"), "-q")[::2])
    assert f"{src}: no tokenizer files" in err, err
    assert not (tmp_path / "out").exists()


def test_text_and_workdir_are_checked_before_any_model_is_loaded_or_converted(default_model, tmp_path, monkeypatch,
                                                                            capsys):
    from quantserve.quant import convert as convert_module
    from quantserve.quant import evaluate as evaluate_module

    def too_late(*args, **kwargs):
        raise AssertionError("converted or loaded a model before checking --text / --workdir")
    monkeypatch.setattr(convert_module, "convert", too_late)
    monkeypatch.setattr(evaluate_module, "_source_logits", too_late)
    out = quantized_copy(default_model, tmp_path / "bnb")
    folder, missing, afile = tmp_path / "texts", tmp_path / "missing.txt", tmp_path / "afile"
    folder.mkdir()
    afile.write_text("not a folder")
    cases = [(["eval", str(default_model), str(out), "--text", str(folder)], f"{folder}: is a folder, not a text file"),
             (["eval", str(default_model), str(out), "--text", str(missing)], f"{missing}: no such text file"),
             (["table", str(default_model), "--workdir", str(tmp_path / "w"), "--formats", "gguf-f16",
               "--text", str(folder)], f"{folder}: is a folder, not a text file"),
             (["table", str(default_model), "--workdir", str(afile), "--formats", "gguf-f16"],
              f"--workdir {afile}: is a file, not a folder")]
    for cmd, want in cases:
        err = one_error_line(*run_cli(monkeypatch, capsys, *cmd)[::2])
        assert want in err, (cmd, err)
    assert not (tmp_path / "w").exists()
