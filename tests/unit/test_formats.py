"""The weight-format registry (quantserve/formats.py): every record's writer exists, and `identify`
recognises each kind of file or folder — the one answer convert, eval, inspect and serve share."""

from __future__ import annotations

import importlib
import json

import pytest

from quantserve.formats import CONVERT_FORMATS, FORMATS, NotAModel, check_format, identify
from quantserve.settings import UsageError


def test_every_written_format_names_a_writer_that_exists():
    from quantserve.quant.llamacpp import KQUANT_FTYPES

    for name in CONVERT_FORMATS:
        module, _, function = FORMATS[name].writer.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name
    # the k-quants listed here are exactly those llama.cpp's quantizer is asked for
    assert [f[5:] for f in CONVERT_FORMATS if FORMATS[f].writer.endswith(":write_kquant")] == list(KQUANT_FTYPES)
    assert all(FORMATS[f].engine in ("hf", "gguf", "fast") for f in FORMATS)


def test_check_format_takes_only_what_convert_writes():
    assert check_format(" GGUF-Q8_0 ").name == "gguf-q8_0"
    for name in ("awq", "hf", "gguf-q3_xs"):
        with pytest.raises(UsageError, match="unknown format"):
            check_format(name)


def _folder(tmp_path, name, quantization=None, **files):
    d = tmp_path / name
    d.mkdir()
    config = {"model_type": "llama"} | ({"quantization_config": quantization} if quantization else {})
    (d / "config.json").write_text(json.dumps(config))
    for file, data in files.items():
        (d / file.replace("_", ".")).write_bytes(data)
    return d


@pytest.mark.parametrize("quantization, expected", [
    (None, "hf"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bnb-int8"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bnb-nf4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "bnb-fp4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
    ({"quant_method": "GPTQ", "bits": 4, "group_size": 128}, "gptq"),
    ({"quant_method": "hqq"}, "hf-quantized"),
])
def test_a_checkpoint_folder_is_its_quantization_config(tmp_path, quantization, expected):
    found = identify(_folder(tmp_path, "m", quantization))
    assert (found.format.name, found.container, found.manifest) == (expected, "hf", None)


def test_gguf_files_and_folders(tmp_path):
    lone = tmp_path / "a"
    lone.mkdir()
    (lone / "x.gguf").write_bytes(b"GGUF" + bytes(60))
    assert identify(lone / "x.gguf").format.name == "gguf"
    assert identify(lone).path == lone / "x.gguf"
    out = tmp_path / "out"  # a `quant convert` output: its manifest names the format and the file
    out.mkdir()
    (out / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    (out / "manifest.json").write_text(json.dumps({"format": "gguf-q4_k_m", "gguf_file": "model.gguf"}))
    found = identify(out)
    assert (found.format.name, found.path, found.format.engine) == ("gguf-q4_k_m", out / "model.gguf", "gguf")
    assert found.manifest["format"] == "gguf-q4_k_m"


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "no such file or folder"),
    (lambda d: (d / "w.bin").write_bytes(b"\x80\x02") and d / "w.bin", "a pickle weight file"),
    (lambda d: (d / "fake.gguf").write_bytes(b"PK\x03\x04") and d / "fake.gguf", "not a GGUF file"),
    (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", "not a model"),
    (lambda d: [(d / f"{i}.gguf").write_bytes(b"GGUF") for i in (1, 2)] and d, "holds 2 .gguf files"),
    (lambda d: d, "no config.json"),
    (lambda d: (d / "config.json").write_text("[1, 2]") and d, "a JSON object was expected"),
    (lambda d: (d / "config.json").write_text('{"quantization_config": [4]}') and d, "quantization_config is a list"),
    (lambda d: (d / "manifest.json").write_text('{"format": "gguf-q8_0", "gguf_file": "model.gguf"}') and d,
     "names 'model.gguf', which is not a file in it"),
    (lambda d: (d / "manifest.json").write_text('{"gguf_file": "../escape.gguf"}') and d, "not a file in it"),
])
def test_what_is_not_a_model_says_why(tmp_path, make, needle):
    with pytest.raises(NotAModel, match=needle):
        identify(make(tmp_path))
