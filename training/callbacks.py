"""What a run shows and leaves behind: a progress bar with tokens/s and ETA, a per-step log, a PNG,
and each rank's GPU memory (peak, and what stays allocated between steps).

The Trainer keeps `state.log_history` inside its checkpoints, so after a resume the log and the
loss curve cover the whole run, not only the part after the crash.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback


class ProgressCallback(TrainerCallback):
    """One line per step on rank 0: step/total, loss, tokens/s (all ranks) and ETA.

    With an eval gate (eval_gate.ExactMatchGate) the step bound is only an upper bound: the ETA
    says so ("ETA <= ..."), and once the gate has set the step the run ends at, the bar counts to
    that step."""

    def __init__(self, enabled: bool = True, gate=None):
        self.enabled, self.gate = enabled, gate
        self.bar = None
        self.t0 = None
        self.tokens0 = 0
        self.step0 = 0
        self.last_loss: float | None = None

    def on_train_begin(self, args, state, control, **kw):
        if not (self.enabled and state.is_world_process_zero):
            return
        from quantserve.progress import Progress

        self.bar = Progress(state.max_steps, "train", "step", initial=state.global_step)
        self.t0, self.tokens0, self.step0 = time.time(), state.num_input_tokens_seen, state.global_step

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.last_loss = logs["loss"]

    def on_step_end(self, args, state, control, **kw):
        if self.bar is None:
            return
        dt = max(time.time() - self.t0, 1e-9)
        tok_s = (state.num_input_tokens_seen - self.tokens0) / dt
        done = state.global_step - self.step0
        end = state.max_steps
        if self.gate is not None and self.gate.stop_at is not None:
            end = self.gate.stop_at
            if self.bar.total != end:
                self.bar.set_total(end)
        at_most = "<= " if self.gate is not None and self.gate.stop_at is None and self.gate.target else ""
        eta = (end - state.global_step) * dt / max(done, 1)
        loss = f"{self.last_loss:.4f}" if self.last_loss is not None else "-"
        self.bar.update(state.global_step, f"loss {loss}  {tok_s:,.0f} tok/s  ETA {at_most}{_fmt(eta)}")

    def on_train_end(self, args, state, control, **kw):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StepLogCallback(TrainerCallback):
    """Adds tokens seen and tokens/s since the previous entry to every loss entry of
    `state.log_history` (the Trainer's own `train_tokens_per_second` averages from the start,
    first-step compile and warm-up included)."""

    def __init__(self):
        self.t_last = None
        self.tokens_last = 0

    def on_train_begin(self, args, state, control, **kw):
        self.t_last, self.tokens_last = time.time(), state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is None or "loss" not in logs or not state.log_history:
            return
        now = time.time()
        entry = state.log_history[-1]  # the Trainer appended a copy of `logs` just before this call
        entry["tokens_seen"] = int(state.num_input_tokens_seen)
        entry["tokens_per_s"] = round((state.num_input_tokens_seen - self.tokens_last) / max(now - self.t_last, 1e-9), 1)
        self.t_last, self.tokens_last = now, state.num_input_tokens_seen


class MemoryCallback(TrainerCallback):
    """Per-rank GPU memory: the peak over the run, and what stays allocated between optimizer steps.

    "Between steps" (read at the start of the second step, after the first optimizer step made the
    optimizer state) is the model state a rank holds: weights, optimizer state and whatever
    DeepSpeed keeps resident; the peak adds activations, logits and gradients.  `quantserve plan`
    predicts both, so `train_log.json` lets a run check the plan.  Nothing is measured on a CPU.
    """

    def __init__(self):
        self.between_steps: int | None = None

    def on_train_begin(self, args, state, control, **kw):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kw):
        import torch

        if self.between_steps is None and state.global_step >= 1 and torch.cuda.is_available():
            torch.cuda.synchronize()
            self.between_steps = torch.cuda.memory_allocated()

    def report(self) -> dict:
        """This rank's figures in GiB (None where not measured)."""
        import torch

        from quantserve.training import distributed

        cuda = torch.cuda.is_available()
        gib = 2**30
        return {"rank": distributed.world()[1],
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "peak_gib": round(torch.cuda.max_memory_allocated() / gib, 3) if cuda else None,
                "between_steps_gib": round(self.between_steps / gib, 3) if self.between_steps else None,
                "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / gib, 3) if cuda else None}


def write_log(out: Path, log_history: list[dict], summary: dict) -> Path:
    """`train_log.json` (summary + per-step entries) and `loss.png`."""
    steps = [e for e in log_history if "loss" in e]
    path = out / "train_log.json"
    path.write_text(json.dumps({**summary, "steps": steps}, indent=1))
    if steps:
        from quantserve.plots import save_loss_plot

        title = f"fine-tune: {summary.get('method')} / ZeRO {summary.get('zero')} x{summary.get('world_size')}"
        save_loss_plot([e["loss"] for e in steps], out / "loss.png", title)
    return path


def _fmt(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"
