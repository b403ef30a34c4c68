"""`quantserve serve` refuses what cannot be served before it binds its port and says "serving":
a model that is no causal LM, a truncated safetensors or GGUF file, a folder without tokenizer
files, a --context past the trained one, a --replicas option without --replicas.  Each was found only after the server had started (or, for
the replica options, never).

Every command runs against a port that is already taken: a check made before the bind answers with
its own line; one made after it (or never) would answer "port in use" instead.  So no model loads
and no server starts here.
"""

from __future__ import annotations

import socket
from contextlib import contextmanager

import pytest

from tests.support.cli import assert_one_line_error, cli
from tests.support.odd_models import odd_models as make_odd_models


@contextmanager
def busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        yield str(busy.getsockname()[1])


def serve(*args: str):
    with busy_port() as port:
        proc = cli("serve", *args, "--port", port, timeout=120)
    assert "serving" not in proc.stdout, proc.stdout
    return proc


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory, default_model):
    return make_odd_models(tmp_path_factory.mktemp("odd-models"), default_model)


@pytest.fixture(scope="module")
def gguf_folder(default_model, tmp_path_factory):
    from quantserve.quant.convert import convert

    return convert(default_model, "gguf-q8_0", tmp_path_factory.mktemp("gguf") / "q8", progress=False)


def engine_error(path, **options) -> str:
    """The ModelLoadError that building the engine raises (the CLI builds it before binding)."""
    from quantserve.server.engines import EngineOptions, ScheduledEngine
    from quantserve.server.exceptions import ModelLoadError

    with pytest.raises(ModelLoadError) as e:
        ScheduledEngine(path, EngineOptions(**options))
    return str(e.value)


@pytest.mark.parametrize("name, architecture", [("bert", "BertModel"), ("t5", "T5ForConditionalGeneration")])
def test_a_model_that_is_not_a_causal_lm_is_refused_in_one_line(odd_models, name, architecture):
    """The BERT loaded, then failed at its warm-up ('NoneType' object has no attribute 'layers');
    the T5's error listed every config class transformers knows, one a line."""
    assert_one_line_error(serve(str(odd_models / name)), 1, f"{odd_models / name}: unsupported architecture "
                          f"{architecture} (not a causal language model")


def test_truncated_weights_are_refused_naming_the_file(odd_models):
    """safetensors' own words named no file ("incomplete metadata, file not fully covered")."""
    assert_one_line_error(serve(str(odd_models / "trunc")), 1,
                          f"{odd_models / 'trunc' / 'model.safetensors'}: safetensors file is truncated")


def test_a_folder_without_tokenizer_files_is_refused_in_one_line(odd_models):
    """It loaded the weights, then failed in transformers' words after "serving"."""
    assert_one_line_error(serve(str(odd_models / "notok")), 1, f"{odd_models / 'notok'}: no tokenizer files")


def test_a_truncated_gguf_is_refused_naming_the_file(gguf_folder, tmp_path):
    """llama.cpp's load failed after "serving" (or, mapped, would have died of SIGBUS)."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((gguf_folder / "model.gguf").read_bytes()[:-4096])
    assert_one_line_error(serve(str(cut)), 1, f"{cut}: corrupt or truncated GGUF file")


def test_a_context_past_the_trained_one_is_refused_before_the_port(default_model, gguf_folder):
    assert_one_line_error(serve(str(default_model), "--context", "99999"), 1,
                          "--context 99999 exceeds the model's trained context of 512 tokens")
    for path, engine in ((default_model, "fast"), (gguf_folder / "model.gguf", "auto")):
        assert engine_error(path, engine=engine, context=99999) == \
            "context 99999 exceeds the model's trained context of 512 tokens"
    # within it, the GGUF check lets the server go on to bind (and find the port taken)
    assert_one_line_error(serve(str(gguf_folder), "--context", "512"), 1, "port in use")


@pytest.mark.parametrize("option", [("--routing", "bogus"), ("--max-replicas", "3"), ("--address", "auto"),
                                    ("--downscale-delay", "5")])
def test_a_replicas_option_without_replicas_is_a_usage_error(default_model, option):
    """It was ignored without a word: one server ran, not the replicas the option was meant for."""
    assert_one_line_error(serve(str(default_model), *option), 2, option[0], "needs --replicas")


def test_with_replicas_their_options_are_still_checked(gguf_folder):
    proc = cli("serve", str(gguf_folder), "--port", "0", "--replicas", "2", "--routing", "bogus", timeout=120)
    assert_one_line_error(proc, 2, "unknown --routing 'bogus'")


def test_a_load_error_is_one_line():
    """What fails while loading reaches the CLI's one error line: a library's lines joined."""
    from quantserve.server.cli import load_error_message
    from quantserve.server.exceptions import ModelLoadError

    assert load_error_message(ValueError("Unrecognized configuration class\nModel type should be one of A, B")) \
        == "ValueError: Unrecognized configuration class Model type should be one of A, B"
    assert load_error_message(ModelLoadError("cannot load\n  it", "context", 8)) == "--context 8 cannot load it"
    assert len(load_error_message(RuntimeError("x\n" * 1000))) < 320
