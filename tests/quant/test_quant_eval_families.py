"""`quant eval` on every model family the converter takes: the quality report is the family's own
(llama.cpp's Q8_0 and bitsandbytes' int8 against transformers fp32 on the same text)."""

from __future__ import annotations

import pytest
from tests.support.families import FAMILIES, family_checkpoint

from quantserve.quant.convert import convert
from quantserve.quant.evaluate import evaluate

TEXT = "\n\n".join(["The capital of Norvania is Velmor. Rivers run north there, and winters are long.",
                    "Count the letters: a b c d e f g. Then sort them backwards: g f e d c b a.",
                    "What is 12 + 30? It is 42, and 42 + 8 is 50."] * 3)


@pytest.mark.parametrize("arch", FAMILIES)
def test_quant_eval_reports_each_familys_own_quality(arch, default_model, tmp_path):
    from quantserve.modeling import load_tokenizer

    tok = load_tokenizer(default_model)
    family_checkpoint(arch, tok, tmp_path / "src", vocab_pad=8, hidden=256, ffn=768, context=512,
                      gemma2={"head_dim": 48, "query_pre_attn_scalar": 48, "sliding_window": 8, "tie": True})
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    # random weights put many next tokens near a tie, so agreement is the loose bound (seen: 0.88-0.98;
    # Gemma 3's six layers the lowest) and the logits' relative error the tight one (seen: 0.011-0.062;
    # a wrong tensor mapping gives ~1)
    for fmt in ("gguf-q8_0", "bnb-int8"):
        out = convert(tmp_path / "src", fmt, tmp_path / fmt, progress=False)
        row = evaluate(tmp_path / "src", out, text)
        assert row["tokens"] > 50 and row["ppl"] > 0 and row["ppl_source"] > 0, row
        assert row["rel_logit_error"] < 0.08 and row["top1_agreement"] >= 0.85, (arch, fmt, row)
        assert abs(row["delta_pct"]) < 2, (arch, fmt, row)
