"""SentencePiece vocabularies (Llama 2, Mistral, Gemma: BPE pieces with byte fallback) in GGUF.

The tokenizer is trained here with SentencePiece itself on the default corpus and converted by
transformers, as those models' tokenizers were; the model is a tiny random Mistral.  llama.cpp
must tokenize every string exactly as SentencePiece does (the format's own reference), and as
transformers does wherever transformers agrees with SentencePiece.  They part in one known place:
text that starts with a space (or follows a special token), where transformers' non-legacy
Llama tokenizer adds no '▁' of its own and SentencePiece (and llama.cpp) do.
"""

from __future__ import annotations

import io
import json
import shutil

import pytest
from tests.support.families import family_checkpoint

from quantserve.quant import llamacpp
from quantserve.quant.convert import convert

pytest.importorskip("sentencepiece", reason="SentencePiece vocabularies need the sentencepiece package")

STRINGS = ["Hello, World!", "Repeat: y n b i q p", "naïve café 漢字 ß 🙂 ∑", "tabs\tand\nnewlines\n\n",
           "What is 12 + 30?", "x" * 40, "trailing  ", "Sort: q w e r t y u i o p", "mid  double   spaces",
           " leading space", "  two leading"]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def spm_checkpoint(request, tmp_path_factory):
    """(checkpoint folder, SentencePiece processor, transformers tokenizer); the prefix param is
    SentencePiece's add_dummy_prefix (Llama 2 / Mistral: on; Gemma: off)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from quantserve.demo import corpus

    root = tmp_path_factory.mktemp("spm")
    texts = [f"{e.prompt} {e.answer}" for e in corpus.pretrain_examples(3000, 0)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=600, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, split_digits=True, unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=request.param,
                                   remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                                   normalization_rule_name="identity", minloglevel=2)
    src = root / "tokenizer"
    src.mkdir()
    (src / "tokenizer.model").write_bytes(buf.getvalue())
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "add_prefix_space": request.param, "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}))
    tok = AutoTokenizer.from_pretrained(str(src))
    ckpt = root / "mistral"
    family_checkpoint("mistral", tok, ckpt)
    shutil.copy(src / "tokenizer.model", ckpt / "tokenizer.model")
    return ckpt, spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model")), tok, request.param


@pytest.mark.parametrize("scores_from", ["tokenizer.model", "merge ranks"])
def test_llama_cpp_tokenizes_as_sentencepiece_and_transformers(spm_checkpoint, scores_from, tmp_path):
    from quantserve.quant.inspect import inspect

    ckpt, sp, tok, prefix = spm_checkpoint
    if scores_from == "merge ranks":  # a checkpoint with tokenizer.json alone
        ckpt = shutil.copytree(ckpt, tmp_path / "json-only")
        (ckpt / "tokenizer.model").unlink()
    from quantserve.support import model_support

    gguf_verdict = next(v for v in model_support(ckpt)["verdicts"] if v["what"] == "formats gguf-*")
    assert gguf_verdict["ok"] and "SentencePiece" in gguf_verdict["why"]
    out = convert(ckpt, "gguf-f16", tmp_path / "gguf", progress=False)
    md = inspect(out / "model.gguf")["metadata"]
    assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.add_space_prefix"] is prefix
    assert json.loads((out / "manifest.json").read_text())["conversion"]["tokenizer"]["scores_from"] == scores_from
    llm = llamacpp.load(out / "model.gguf", n_ctx=64, logits_all=False)
    try:
        for text in STRINGS:
            ours = llamacpp.tokenize(llm, text)
            assert ours == [1] + sp.encode(text), (text, ours, sp.encode(text))
            if not (prefix and text.startswith(" ")):  # transformers' non-legacy prefix rule, above
                assert ours == tok(text).input_ids, (text, ours, tok(text).input_ids)
        # byte fallback: a character SentencePiece never saw is its UTF-8 bytes
        assert llm.detokenize(llamacpp.tokenize(llm, "漢", add_bos=False)).decode().strip() == "漢"
    finally:
        llm.close()
