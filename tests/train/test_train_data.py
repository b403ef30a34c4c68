"""Training data: JSONL checks with line numbers, assistant-only labels, packing, the collator."""

from __future__ import annotations

import json

import pytest

from quantserve.settings import UserError
from quantserve.training import data as D


@pytest.fixture(scope="module")
def tok(default_model):
    from quantserve.modeling import load_tokenizer

    return load_tokenizer(default_model)


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


CHAT = json.dumps({"messages": [{"role": "user", "content": "Reverse: [a,b,c,d]"},
                                {"role": "assistant", "content": "[d,c,b,a]"}]})


def test_malformed_lines_are_reported_with_line_numbers(tmp_path):
    p = write(tmp_path, [CHAT, "{not json", CHAT, json.dumps({"foo": 1}), json.dumps([1, 2])])
    with pytest.raises(UserError) as e:
        D.read_jsonl(p)
    msg = str(e.value)
    assert "3 malformed line(s)" in msg and "line 2:" in msg and "line 4:" in msg and "line 5:" in msg
    assert "--skip-bad-lines" in msg and "\n" not in msg


def test_skip_bad_lines_keeps_the_good_ones(tmp_path, capsys):
    p = write(tmp_path, [CHAT, "{not json", CHAT])
    recs = D.read_jsonl(p, skip_bad_lines=True)
    assert [r.line for r in recs] == [1, 3]
    assert "skipped line 2" in capsys.readouterr().err


@pytest.mark.parametrize("line, why", [
    (json.dumps({"messages": []}), "non-empty list"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), "'role'"),
    (json.dumps({"text": ""}), "non-empty string"),
])
def test_invalid_records(tmp_path, line, why):
    with pytest.raises(UserError, match=why):
        D.read_jsonl(write(tmp_path, [line]))


def test_empty_data_is_an_error(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(UserError, match="no training records"):
        D.read_jsonl(p)


def test_loss_only_on_assistant_turns(tok):
    msgs = [{"role": "user", "content": "Reverse: [a,b,c,d]"}, {"role": "assistant", "content": "[d,c,b,a]"},
            {"role": "user", "content": "Repeat: [x,y]"}, {"role": "assistant", "content": "[x,y]"}]
    ids, labels = D.encode_chat(tok, msgs)
    assert ids == tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    kept = [i for i, lab in zip(ids, labels) if lab != D.IGNORE]
    text = tok.decode(kept)
    # Both answers and their end-of-turn markers, nothing of the user turns or the role headers.
    assert text.count("<|im_end|>") == 2
    assert "[d,c,b,a]" in text and "[x,y]" in text
    assert "Reverse" not in text and "Repeat" not in text and "user" not in text and "assistant" not in text


def test_text_records_train_on_every_token(tok):
    ids, labels = D.encode_text(tok, "hello world")
    assert ids == labels and ids[-1] == tok.eos_token_id


def test_too_long_without_packing_names_the_line(tok, tmp_path):
    recs = D.read_jsonl(write(tmp_path, [CHAT, json.dumps({"text": "a b c " * 50})]))
    with pytest.raises(UserError, match=r"line 2 \("):
        D.encode(tok, recs, seq_len=32, packing=False)
    packed = D.encode(tok, recs, seq_len=32, packing=True)
    assert all(len(e["input_ids"]) == 32 for e in packed) and len(packed) >= 3


def test_collator_pads_and_masks(tok):
    batch = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "idx": 0},
             {"input_ids": [5], "labels": [5], "idx": 1}]
    c = D.Collator(tok.pad_token_id, max_len=16)
    c.seen = []
    out = c(batch)
    assert out["input_ids"].shape == (2, 8)
    assert out["attention_mask"].sum().item() == 4
    assert out["labels"][1, 1:].eq(D.IGNORE).all()
    assert c.seen == [0, 1]
