"""The fine-tune does its job: held-out exact match on the default task from ~0 % to >= 90 %.

Uses `train()` exactly as the pipeline does, with the default task's gated recipe (`corpus.task_finetune`): trained until
the dev split passes, so the test also proves the gate stops a run and the held-out split agrees.
"""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.slow


def test_full_finetune_lifts_heldout_exact_match(default_model, tmp_path):
    from quantserve.demo.corpus import read_examples, task_finetune, write_default_data
    from quantserve.modeling import load_model, load_tokenizer, task_accuracy
    from quantserve.training.config import TrainConfig
    from quantserve.training.train import train

    files = write_default_data(tmp_path / "data")
    heldout = read_examples(files["task_heldout"])
    tok = load_tokenizer(default_model)
    before = task_accuracy(load_model(default_model), tok, heldout)

    t0 = time.time()
    out = train(TrainConfig(data=files["task_train"], out=tmp_path / "ft", progress=False,
                            **task_finetune(files)))
    seconds = time.time() - t0
    after = task_accuracy(load_model(out), load_tokenizer(out), heldout)
    log = json.loads((out / "train_log.json").read_text())
    print(f"\nheld-out exact match on the task: {before:.1%} -> {after:.1%} "
          f"({log['global_step']} steps, loss {log['steps'][0]['loss']:.3f} -> {log['steps'][-1]['loss']:.3f}, "
          f"{seconds:.0f} s; gate checks {[(e['step'], e['eval_exact_match']) for e in log['eval']]})")
    assert before <= 0.05
    assert after >= 0.90
    assert (out / "loss.png").stat().st_size > 1000
