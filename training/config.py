"""The typed training config: every knob of `quantserve train`, checked before any memory is touched.

`TrainConfig` is the one source of truth; the CLI mirrors its fields and `train()` takes it.
`validate()` turns every impossible request into a `UserError` (one line, non-zero exit) while the
process has still done nothing expensive: no model loaded, no GPU memory allocated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from quantserve.settings import UsageError, UserError, require_creatable_folder

METHODS = ("full", "lora", "qlora")
OFFLOADS = ("none", "optimizer", "all")
ATTENTIONS = ("auto", "flash2", "sdpa", "eager")
DTYPES = ("auto", "fp16", "bf16", "fp32")
ATTN_IMPL = {"flash2": "flash_attention_2", "sdpa": "sdpa", "eager": "eager"}
# Learning-rate schedules (after the linear warmup), as transformers names them.
SCHEDULES = {"cosine": "cosine", "constant": "constant_with_warmup", "linear": "linear"}
# Settings only LoRA / QLoRA read: set for a full fine-tune they would do nothing, so they are refused.
LORA_ONLY = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "merge")


_JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a path (a string)"}


def _check_type(path: Path, name: str, value, annotation) -> None:
    """A config file's value against its field's type: JSON gives bools, numbers and strings, and a
    "yes" where a bool belongs would otherwise be taken as true."""
    import typing

    allowed = [t for t in typing.get_args(annotation) if t is not type(None)] or [annotation]
    if value is None and type(None) in typing.get_args(annotation):
        return
    for t in allowed:
        if t is bool and isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t in (str, Path) and isinstance(value, str):
            return
    want = " or ".join(_JSON_NAMES.get(t, t.__name__) for t in allowed)
    raise UserError(f"{path}: \"{name}\" must be {want}, not {json.dumps(value)}")


@dataclass
class TrainConfig:
    data: Path
    out: Path
    model: str = "default"  # a checkpoint folder, or "default" for the embedded model
    method: str = "full"  # full | lora | qlora
    zero: Optional[int] = None  # DeepSpeed ZeRO stage 0-3; None trains without DeepSpeed
    offload: str = "none"  # none | optimizer | all (all = optimizer + parameters, ZeRO-3 only)
    liger: Optional[bool] = None  # None: on where the GPU supports it
    attn: str = "auto"
    grad_ckpt: bool = False
    micro_batch: int = 16
    global_batch: Optional[int] = None  # None: micro_batch x world size (no accumulation)
    seq_len: Optional[int] = None  # None: the model's limit, capped at 2048
    packing: bool = False
    # A batch whose examples differ in length runs padding-free (one row, positions restarting per
    # example) where that computes less than padding; the loss is the same (data.Collator).
    padding_free: bool = True
    dtype: str = "auto"  # auto picks what capabilities.detect() says: bf16 > fp16 > fp32 on CPU
    gpu_profile: Optional[str] = None
    plan: Optional[str] = None  # "auto": let `training.plan` pick zero/offload/ckpt/micro-batch
    # Optimisation.  Defaults: the best of a small sweep on the default task (lr 5e-4..6e-3,
    # micro-batch 8..32); higher rates than 1e-3 set the pretrained model back before it learns.
    epochs: float = 3.0
    max_steps: Optional[int] = None  # overrides epochs when set
    lr: float = 1e-3
    lr_schedule: str = "cosine"  # cosine | constant | linear, after the warmup
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # LoRA / QLoRA
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: str = "all-linear"  # comma-separated module names, or peft's "all-linear"
    merge: bool = False  # LoRA: also write merged full weights as the output checkpoint
    # Held-out gate (training/eval_gate.py): score `eval_data` every `eval_steps` steps and stop
    # once the greedy exact match reaches `stop_at_exact_match`; epochs/max_steps stay the bound.
    eval_data: Optional[Path] = None
    eval_steps: int = 100
    stop_at_exact_match: Optional[float] = None
    # once the gate passes: the learning rate decays to 0 over this fraction of the steps so far
    gate_cooldown: float = 0.0
    # Bookkeeping
    skip_bad_lines: bool = False
    resume: bool = True  # continue from the last checkpoint in `out` if one is there
    force: bool = False  # retrain even when `out` holds a finished run of this same config
    save_steps: int = 50
    save_total_limit: int = 2
    logging_steps: int = 1
    seed: int = 0
    progress: bool = True
    threads: Optional[int] = None  # CPU threads per process; None leaves torch's default
    audit_data: bool = False  # record which examples each rank trained on (data_audit/rankN.json)

    def __post_init__(self) -> None:
        self.data, self.out = Path(self.data), Path(self.out)
        if self.eval_data is not None:
            self.eval_data = Path(self.eval_data)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_file(cls, path: Path, **overrides) -> "TrainConfig":
        """The settings of a JSON file (keys are the field names), `overrides` on top."""
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as e:
            raise UserError(f"{path}: cannot read the config ({e.strerror or e})") from None
        except ValueError as e:
            raise UserError(f"{path}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path}: a config is a JSON object of settings, not {type(raw).__name__}")
        unknown = sorted(set(raw) - cls.field_names())
        if unknown:
            raise UserError(f"{path}: unknown config keys {unknown}")
        import typing

        types = typing.get_type_hints(cls)
        for name, value in raw.items():
            _check_type(path, name, value, types[name])
        merged = {**raw, **overrides}
        for name in ("data", "out"):
            if merged.get(name) is None:
                raise UsageError(f"--{name} is required (on the command line or as \"{name}\" in {path})")
        try:
            return cls(**merged)
        except TypeError as e:
            raise UserError(f"{path}: {e}") from None

    def as_dict(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}

    def chosen(self, given: Collection[str] = ()) -> set[str]:
        """The settings this run asks for: `given` (the command line's, which the CLI can tell apart
        even where they equal the default) and every one that differs from its default (a config
        file's, code's)."""
        return set(given) | {f.name for f in fields(self)
                             if f.default is not MISSING and getattr(self, f.name) != f.default}

    def validate(self, given: Collection[str] = ()) -> None:
        """Static checks that need neither the model nor the GPU.  `given`: the settings named on
        the command line (see `chosen`), so that one which would do nothing is refused."""
        _choice("--method", self.method, METHODS)
        _choice("--offload", self.offload, OFFLOADS)
        _choice("--attn", self.attn, ATTENTIONS)
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--lr-schedule", self.lr_schedule, tuple(SCHEDULES))
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise UsageError(f"--zero must be 0, 1, 2 or 3, not {self.zero}")
        if self.plan not in (None, "auto"):
            raise UsageError(f"--plan must be 'auto', not {self.plan!r}")
        if self.method == "qlora" and self.zero == 3:
            raise UserError("QLoRA does not combine with ZeRO-3 (4-bit weights cannot be partitioned): "
                            "use --zero 2 (or none)")
        if self.offload != "none" and self.zero is None:
            raise UserError("--offload needs DeepSpeed: add --zero 2 (optimizer) or --zero 3 (all)")
        if self.offload == "optimizer" and self.zero == 0:
            raise UserError("optimizer offload needs ZeRO stage 1 or more (--zero 2 recommended)")
        if self.offload == "all" and self.zero != 3:
            raise UserError("--offload all (parameters too) needs --zero 3")
        if self.save_steps < 0:
            raise UsageError("--save-steps must be 0 (no resumable checkpoints) or more")
        for name in ("micro_batch", "lora_r", "lora_alpha", "logging_steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
        if self.global_batch is not None and self.global_batch < 1:
            raise UsageError("--global-batch must be at least 1")
        if self.seq_len is not None and self.seq_len < 8:
            raise UsageError("--seq-len must be at least 8")
        if self.max_steps is not None and self.max_steps < 1:
            raise UsageError("--max-steps must be at least 1")
        # NaN passes every comparison and inf trains a model of NaNs: finite first
        for flag, value, ok in (("--epochs", self.epochs, self.epochs > 0), ("--lr", self.lr, self.lr > 0),
                                ("--warmup-ratio", self.warmup_ratio, 0 <= self.warmup_ratio < 1),
                                ("--weight-decay", self.weight_decay, self.weight_decay >= 0),
                                ("--max-grad-norm", self.max_grad_norm, self.max_grad_norm >= 0),
                                ("--lora-dropout", self.lora_dropout, 0 <= self.lora_dropout < 1)):
            if not (math.isfinite(value) and ok):
                raise UsageError(f"{flag} {value} is out of range (--epochs, --lr: positive; --warmup-ratio, "
                                 "--lora-dropout: in [0, 1); --weight-decay, --max-grad-norm: 0 or more)")
        if self.threads is not None and self.threads < 1:
            raise UsageError("--threads must be at least 1 (leave it out for torch's default)")
        if self.save_total_limit < 1:
            raise UsageError("--save-total-limit must be at least 1 (the checkpoint a run resumes from)")
        if self.eval_steps < 1:
            raise UsageError("--eval-steps must be at least 1")
        # Settings that only another method or feature reads: refused, never silently ignored.
        chosen = self.chosen(given)
        lora = [_flag(name) for name in LORA_ONLY if name in chosen]
        if lora and self.method == "full":
            raise UserError(f"{', '.join(lora)} appl{'ies' if len(lora) == 1 else 'y'} to --method lora/qlora "
                            "only (this run is a full fine-tune)")
        if "padding_free" in chosen and self.packing:
            raise UserError("--padding-free / --padded lay out unpacked batches; with --packing every row is "
                            "already a full seq-len block: leave it out")
        if "eval_steps" in chosen and self.eval_data is None:
            raise UserError("--eval-steps needs --eval-data (it is the number of steps between its checks)")
        if self.stop_at_exact_match is not None:
            if self.eval_data is None:
                raise UserError("--stop-at-exact-match needs --eval-data (the prompts it is scored on)")
            if not 0 < self.stop_at_exact_match <= 1:
                raise UserError("--stop-at-exact-match is a fraction in (0, 1], e.g. 0.95")
        if self.gate_cooldown:
            if self.stop_at_exact_match is None:
                raise UserError("--gate-cooldown needs --stop-at-exact-match (it starts when that is reached)")
            if not 0 < self.gate_cooldown <= 1:
                raise UserError("--gate-cooldown is a fraction of the steps so far, in (0, 1], e.g. 0.25")
        if self.eval_data is not None:
            if not self.eval_data.is_file():
                raise UserError(f"{self.eval_data}: no such eval data file")
            if self.zero == 3:
                raise UserError("--eval-data scores by generating, which ZeRO-3's partitioned weights do "
                                "not support here: use --zero 2 (or none)")
        if not self.data.exists():
            raise UserError(f"{self.data}: no such data file")
        if self.data.is_dir():
            raise UserError(f"{self.data}: is a folder, expected a JSONL file")
        require_creatable_folder(self.out)
        base = Path(self.model).resolve()
        out = self.out.resolve()
        # never, not even with --force: the run would write over the model it starts from, or (a
        # checkpoint-* folder of the run's own) clear it with its old checkpoints
        if Path(self.model).is_dir() and (out == base or (base.parent == out and base.name.startswith("checkpoint-"))):
            raise UserError(f"--out {self.out} holds the base model {self.model}: choose another --out")

    def accumulation(self, world_size: int) -> int:
        """Gradient accumulation steps that turn micro-batches on `world_size` ranks into the global batch."""
        if self.global_batch is None:
            return 1
        per_step = self.micro_batch * world_size
        if self.global_batch % per_step:
            raise UserError(f"--global-batch {self.global_batch} is not a multiple of micro-batch x ranks "
                            f"= {self.micro_batch} x {world_size} = {per_step}")
        return self.global_batch // per_step


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")


@dataclass
class Resolved:
    """What the checks against this machine decided: the facts a run is built on (and logs)."""

    device: str
    dtype: str  # "float16", "bfloat16" or "float32"
    attention: str  # attn_implementation given to transformers
    liger: bool
    liger_reason: str
    world_size: int
    rank: int
    local_rank: int
    notes: list[str] = field(default_factory=list)
