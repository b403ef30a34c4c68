"""One fine-tune of the default pipeline's recipe with some settings changed, as runs.json records.

    OUT=/tmp/finetune-recipes python bench/results/finetune-recipes-2026-12-05/run_variant.py \
        NAME [n_task_train=2000 n_tool_train=2000] [lr=0.0005] [seed=1] [dtype=bf16] [threads=2]

`n_*` are write_default_data's sizes; every other key=value is a TrainConfig field. One thread
unless `threads` says otherwise; no checkpoints saved (so the timing is the steps and the gate's
checks). Prints one RESULT line: seconds, steps and every gate check.
"""
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from quantserve.demo import corpus
from quantserve.demo.default_model import resolve_model
from quantserve.training.config import TrainConfig
from quantserve.training.train import train

name, settings = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
root = Path(os.environ.get("OUT", "/tmp/finetune-recipes")) / name
sizes = {k: int(settings.pop(k)) for k in list(settings) if k.startswith("n_")}
(root / "data").mkdir(parents=True, exist_ok=True)
files = corpus.write_default_data(root / "data", **sizes)

kinds = {f.name: str(f.type) for f in fields(TrainConfig)}
recipe = corpus.task_finetune(files)
for key, value in settings.items():
    kind = kinds[key]  # e.g. 'float', 'int', 'Optional[int]', 'str'
    recipe[key] = float(value) if "float" in kind else int(value) if "int" in kind else value
config = TrainConfig(data=files["task_train"], out=root / "out", model=str(resolve_model("default", progress=False)),
                     method="full", progress=False, force=True, resume=False, save_steps=100_000,
                     **{"threads": 1, **recipe})
start = time.time()
train(config)
log = json.loads((root / "out" / "train_log.json").read_text())
print("RESULT", name, sys.argv[2:], "seconds", round(time.time() - start, 1), "steps", log["global_step"],
      "evals", [(e["step"], e["eval_exact_match"]) for e in log["eval"]], flush=True)
