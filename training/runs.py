"""Which run an output folder holds, so that a rerun does the right thing: the same command again
finds its finished run (and does not train on) or its last complete checkpoint (and resumes from
it); a command of another config or data finds that the folder holds someone else's run.

A run's identity is its config, less the settings that do not change what it computes, and the
content of its data file; `run.json` in the folder records it as soon as training starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from quantserve.training import distributed
from quantserve.training.config import TrainConfig
from quantserve.training.distributed import log

# Settings that do not change what a run computes: a rerun differing only in them is the same run.
_BOOKKEEPING = ("progress", "resume", "force", "threads", "save_steps", "save_total_limit", "logging_steps")


def finished_run(cfg: TrainConfig, identity: dict) -> int | None:
    """The step count of a finished run of this same config in `cfg.out` (its train_log.json and
    weights are there), or None.  A rerun of a finished command must not train on: resuming from
    its last checkpoint would add a step and overwrite the model."""
    log_file = cfg.out / "train_log.json"
    if cfg.force or not log_file.is_file():
        return None
    try:
        record = json.loads(log_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    same = identity == {"config": {k: v for k, v in record.get("config", {}).items() if k not in _BOOKKEEPING},
                        "data_fingerprint": record.get("data_fingerprint")}
    weights = any(cfg.out.glob("*.safetensors")) or (cfg.out / "adapter_config.json").is_file()
    return record.get("global_step") if same and weights else None


RUN_FILE = "run.json"


def run_identity(cfg: TrainConfig) -> dict:
    """What makes two runs the same run: the config (minus bookkeeping) and the data's content."""
    config = {k: v for k, v in cfg.as_dict().items() if k not in _BOOKKEEPING}
    return {"config": json.loads(json.dumps(config, default=str)), "data_fingerprint": data_fingerprint(cfg.data)}


def is_run_folder(out: Path) -> bool:
    """Whether `out` is empty or a training run's folder: its run.json (written first), or from
    before run.json, a checkpoint's trainer_state.json or the pipeline's stage.json.  Anything
    else there is someone's files, which a run must not write over."""
    return (not any(out.iterdir()) or (out / RUN_FILE).exists() or (out / "stage.json").exists()
            or any(out.glob("checkpoint-*/trainer_state.json")))


def other_run(cfg: TrainConfig, identity: dict | None = None) -> str | None:
    """If `cfg.out` holds a checkpoint of (or a finished) run of another config or data: what differs.
    `identity`: `run_identity(cfg)` where the caller has it."""
    path = cfg.out / RUN_FILE
    if not path.is_file():
        return None  # nothing there, or a run from before run.json existed
    if not _checkpoint_folders(cfg.out) and not (cfg.out / "train_log.json").is_file():
        return None  # it stopped (failed, Ctrl-C) before its first checkpoint: nothing of it to keep
    try:
        theirs = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    ours = identity or run_identity(cfg)
    if theirs == ours:
        return None
    if theirs.get("data_fingerprint") != ours["data_fingerprint"]:
        return "its data differs"
    old = theirs.get("config", {})
    changed = sorted(k for k in set(old) | set(ours["config"]) if old.get(k) != ours["config"].get(k))
    return "different " + ", ".join(f"--{k.replace('_', '-')}" for k in changed[:4])


def data_fingerprint(path: Path) -> str | None:
    """The data file's content hash (size and mtime above 256 MiB, where hashing would be slow)."""
    import hashlib

    try:
        st = Path(path).stat()
        if st.st_size > 256 << 20:
            return f"{st.st_size}:{st.st_mtime_ns}"
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def _checkpoint_folders(out: Path) -> dict[int, Path]:
    """step -> the Trainer's `checkpoint-N` folder in `out`, finished or not."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return {int(p.name.rsplit("-", 1)[1]): p for p in Path(out).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if p.is_dir() and p.name.rsplit("-", 1)[1].isdigit()}


def _complete(checkpoint: Path) -> bool:
    from transformers.trainer import TRAINER_STATE_NAME

    return (checkpoint / TRAINER_STATE_NAME).is_file()  # the Trainer writes it last


def newest_saved_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint the Trainer finished writing, looked up only (nothing removed)."""
    steps = _checkpoint_folders(out)
    return next((steps[s] for s in sorted(steps, reverse=True) if _complete(steps[s])), None)


def last_complete_checkpoint(out: Path) -> str | None:
    """The newest `checkpoint-N` in `out` that the Trainer finished writing, or None.

    The Trainer writes trainer_state.json last, so a run killed while saving leaves a newer folder
    without it; transformers' `get_last_checkpoint` would pick that one and the resume would fail.
    Such folders are skipped (every rank) and removed (rank 0), so the run resumes from the one before.
    """
    steps = _checkpoint_folders(out)
    for step in sorted(steps, reverse=True):
        if _complete(steps[step]):
            return str(steps[step])
        log(f"{steps[step]} is incomplete (the run was stopped while saving it): removing it")
        if distributed.world()[1] == 0:
            shutil.rmtree(steps[step], ignore_errors=True)
    return None
