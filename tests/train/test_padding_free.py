"""Padding-free batches: the collator's choice of layout, and the same loss and gradients as the
padded batch for every model family the trainer takes (transformers builds the flat row's mask
from its positions; a family where it did not would let examples attend to each other)."""

from __future__ import annotations

import pytest

from quantserve.training import data as D
from tests.support.families import FAMILIES, family_checkpoint


def examples(lengths, vocab=200, seed=0):
    import random

    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        labels = [D.IGNORE if t < n // 2 else ids[t] for t in range(n)]  # loss on the second half
        out.append({"input_ids": ids, "labels": labels, "idx": i})
    return out


def test_uneven_short_examples_go_flat_and_even_or_single_ones_stay_padded():
    h = 256
    assert D.flat_is_cheaper([20, 24, 150, 30], h)  # the default task's mix: padding was 3x the tokens
    assert not D.flat_is_cheaper([64, 64, 64, 64], h)  # nothing to save; the dense mask costs more
    assert not D.flat_is_cheaper([150], h)
    assert not D.flat_is_cheaper([4096, 100, 100, 4096, 100], 4096)  # > MAX_FLAT_TOKENS: its mask
    assert D.flat_is_cheaper([4096, 100, 100, 4096, 100], 4096, attention="flash_attention_2")
    # eager attention keeps every score: a flat row may not score more pairs than padding does
    assert D.flat_is_cheaper([512, 300, 200, 1024] * 2, 4096)
    assert not D.flat_is_cheaper([512, 300, 200, 1024] * 2, 4096, attention="eager")
    # long sequences on a small model: attention dominates, so the dense T^2 mask loses
    assert not D.flat_is_cheaper([2000, 1000, 1000, 1000], 64)
    assert not D.flat_is_cheaper([20, 24, 150, 30], 0)  # no hidden size known: padded


def test_the_flat_batch_is_one_row_with_positions_restarting_at_each_example():
    batch = examples([5, 3, 9])
    c = D.Collator(0, max_len=64, padding_free=True, hidden_size=256)
    c.seen = []
    out = c(batch)
    assert out["input_ids"].shape == (1, 17) and out["use_cache"] is False and "attention_mask" not in out
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    starts = [0, 5, 8]  # no position predicts an example's first token from the one before it
    assert all(out["labels"][0, s].item() == D.IGNORE for s in starts)
    assert out["input_ids"][0].tolist() == [t for e in batch for t in e["input_ids"]]
    assert c.seen == [0, 1, 2]
    padded = D.Collator(0, max_len=64, padding_free=False)(batch)
    assert padded["input_ids"].shape == (3, 16) and "position_ids" not in padded


@pytest.mark.parametrize("arch", ["llama", *FAMILIES])
def test_flat_and_padded_batches_give_the_same_loss_and_gradients(arch, tmp_path, default_model):
    import torch

    from quantserve.modeling import load_tokenizer

    tok = load_tokenizer(default_model)
    if arch == "llama":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32)
    else:  # Gemma's sliding windows (6 tokens) are shorter than these examples: masks combined
        model = family_checkpoint(arch, tok, tmp_path / arch)
    model.train().requires_grad_(True)
    batch = examples([7, 19, 12, 30], vocab=len(tok))
    flat = D.Collator(tok.pad_token_id, 64, padding_free=True, hidden_size=model.config.hidden_size)(batch)
    assert "position_ids" in flat  # this mix does go flat
    padded = D.Collator(tok.pad_token_id, 64, padding_free=False)(batch)
    weight = model.get_input_embeddings().weight
    losses, grads = [], []
    for inputs in (padded, flat):
        loss = model(**inputs).loss
        losses.append(loss.item())
        grads.append(torch.autograd.grad(loss, weight)[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), arch
    # float32 sums in another order; examples attending to each other would differ at the grads' scale
    assert (grads[1] - grads[0]).abs().max() <= 1e-4 * grads[0].abs().max(), arch


def test_packed_blocks_restart_positions_at_each_example_and_never_predict_across():
    blocks = D.pack(examples([5, 3, 9, 4]), seq_len=8)
    assert len(blocks) == 2 and all(len(b["input_ids"]) == 8 for b in blocks)
    # the third example is cut by the block boundary: its rest starts at 0 in the next block
    assert blocks[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert blocks[1]["position_ids"] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert blocks[0]["labels"][0] == blocks[0]["labels"][5] == D.IGNORE  # examples' first tokens
    batch = D.Collator(0, max_len=8)(blocks)
    assert batch["position_ids"].shape == (2, 8) and "attention_mask" not in batch and batch["use_cache"] is False
    flat = D.Collator(0, max_len=8, attention="flash_attention_2")(blocks)  # flash-attention: one row
    assert flat["position_ids"].shape == (1, 16)


def test_a_packed_block_computes_each_example_as_if_it_were_alone(default_model):
    """Every token's logits in a packed block equal those of its example's piece run on its own:
    no example attends to another (before, packed examples saw the ones before them)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    blocks = D.pack(examples([7, 19, 12, 30, 9], vocab=model.config.vocab_size), seq_len=32)
    batch = D.Collator(0, max_len=32)(blocks)
    with torch.no_grad():
        packed = model(**batch).logits
        for row, block in enumerate(blocks):
            starts = [i for i, p in enumerate(block["position_ids"]) if p == 0] + [32]
            assert len(starts) > 2  # several examples in the block
            for a, b in zip(starts, starts[1:]):
                alone = model(input_ids=torch.tensor([block["input_ids"][a:b]])).logits[0]
                torch.testing.assert_close(packed[row, a:b], alone, rtol=1e-4, atol=1e-4)
