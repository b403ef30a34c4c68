"""Held-out task and tool-call exact match, and the pretrained skills, of run_variant.py's runs:
    OUT=/tmp/finetune-recipes python bench/results/finetune-recipes-2026-12-05/score_variant.py NAME ..."""
import os
import sys
from pathlib import Path

from quantserve.demo.corpus import read_examples
from quantserve.demo.default_model import skill_scores
from quantserve.modeling import load_model, load_tokenizer, task_accuracy

for name in sys.argv[1:]:
    root = Path(os.environ.get("OUT", "/tmp/finetune-recipes")) / name
    model, tok = load_model(root / "out"), load_tokenizer(root / "out")
    print(name, "task", task_accuracy(model, tok, read_examples(root / "data/task_heldout.jsonl")),
          "tool", task_accuracy(model, tok, read_examples(root / "data/tool_heldout.jsonl")),
          "skills", skill_scores(model, tok, seed=7), flush=True)
