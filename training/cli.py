"""`quantserve train` and `quantserve plan`: thin typer front-ends for `training.train` / `training.plan`.

`--nproc N` (and `--hostfile`) re-launch the very same command on N processes per node through
torchrun (one node) or DeepSpeed's launcher (several nodes); each process then runs `train()`
with the launcher's RANK/WORLD_SIZE.  Heavy libraries load inside the functions only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from quantserve.settings import UsageError, UserError
from quantserve.training.config import TrainConfig as D  # the one source of defaults


def train_command(
    ctx: typer.Context,
    data: Optional[Path] = typer.Option(None, help="JSONL of {\"text\": ...} or chat {\"messages\": [...]} records (required, here or in --config)."),
    out: Optional[Path] = typer.Option(None, help="Output folder: the checkpoint, train_log.json, loss.png (required, here or in --config)."),
    config: Optional[Path] = typer.Option(None, "--config", help="JSON file of these settings by name ({\"method\": \"lora\", \"lr\": 1e-4, ...}); options given on the command line override it."),
    model: str = typer.Option(D.model, help="Checkpoint folder to fine-tune; 'default' is the embedded model."),
    method: str = typer.Option(D.method, help="full | lora | qlora"),
    zero: Optional[int] = typer.Option(D.zero, help="DeepSpeed ZeRO stage 0-3 (default: no DeepSpeed)."),
    offload: str = typer.Option(D.offload, help="none | optimizer | all (all: ZeRO-3 parameters too). Slow: last resort."),
    liger: Optional[bool] = typer.Option(D.liger, "--liger/--no-liger", help="Liger kernels (default: on where the GPU supports them)."),
    attn: str = typer.Option(D.attn, help="auto | flash2 | sdpa | eager"),
    grad_ckpt: bool = typer.Option(D.grad_ckpt, "--grad-ckpt/--no-grad-ckpt", help="Activation checkpointing."),
    micro_batch: int = typer.Option(D.micro_batch, help="Sequences per process per step."),
    global_batch: Optional[int] = typer.Option(D.global_batch, help="Sequences per optimizer step over all ranks (gradient accumulation)."),
    seq_len: Optional[int] = typer.Option(D.seq_len, help="Maximum tokens per sequence (default: the model's limit, at most 2048)."),
    packing: bool = typer.Option(D.packing, help="Concatenate examples into seq-len blocks (no example attends to another)."),
    padding_free: bool = typer.Option(D.padding_free, "--padding-free/--padded", help="Batches of uneven examples as one row without padding where that computes less (same loss)."),
    dtype: str = typer.Option(D.dtype, help="auto | fp16 | bf16 | fp32 (auto: bf16 where supported, fp16 on a T4)."),
    gpu_profile: Optional[str] = typer.Option(D.gpu_profile, "--gpu-profile", help="'t4': behave like a T4 (fp16, 15 GiB)."),
    plan: Optional[str] = typer.Option(D.plan, help="'auto': let the planner choose ZeRO stage, offload and checkpointing."),
    epochs: float = typer.Option(D.epochs, help="Passes over the data (overridden by --max-steps)."),
    max_steps: Optional[int] = typer.Option(D.max_steps, help="Stop after this many optimizer steps (overrides --epochs)."),
    lr: float = typer.Option(D.lr, help="Peak learning rate (reached after the warmup)."),
    lr_schedule: str = typer.Option(D.lr_schedule, help="cosine | constant | linear (after the warmup)."),
    warmup_ratio: float = typer.Option(D.warmup_ratio),
    eval_data: Optional[Path] = typer.Option(D.eval_data, help="Chat JSONL scored by greedy exact match of its last assistant message, every --eval-steps."),
    eval_steps: int = typer.Option(D.eval_steps, help="Optimizer steps between --eval-data checks."),
    stop_at_exact_match: Optional[float] = typer.Option(D.stop_at_exact_match, help="Stop once --eval-data's exact match reaches this fraction (epochs / --max-steps stay the bound)."),
    gate_cooldown: float = typer.Option(D.gate_cooldown, help="Once --stop-at-exact-match is reached: decay the learning rate to 0 over this fraction of the steps so far, then stop (0: stop at once)."),
    lora_r: int = typer.Option(D.lora_r),
    lora_alpha: int = typer.Option(D.lora_alpha),
    lora_targets: str = typer.Option(D.lora_targets, help="Comma-separated module names, or all-linear."),
    merge: bool = typer.Option(D.merge, help="LoRA: write merged full weights as the output checkpoint (adapter in OUT/adapter)."),
    skip_bad_lines: bool = typer.Option(D.skip_bad_lines, help="Skip malformed JSONL lines (reported) instead of stopping."),
    resume: bool = typer.Option(D.resume, "--resume/--no-resume", help="Continue from the last checkpoint in OUT."),
    force: bool = typer.Option(D.force, "--force", help="Retrain even when OUT holds a finished run of this config."),
    save_steps: int = typer.Option(D.save_steps, help="Checkpoint every N steps (for resuming); 0: only the final model."),
    seed: int = typer.Option(D.seed),
    nproc: int = typer.Option(1, help="Processes (GPUs) per node; >1 re-launches through torchrun."),
    hostfile: Optional[Path] = typer.Option(None, help="DeepSpeed hostfile for multi-node runs."),
    audit_data: bool = typer.Option(D.audit_data, help="Record the example indices each rank trained on."),
    quiet: bool = typer.Option(False, help="No progress bar."),
    local_rank: Optional[int] = typer.Option(None, "--local_rank", hidden=True, help="Set by the deepspeed launcher."),
) -> None:
    """Fine-tune a model (full, LoRA or QLoRA; optionally DeepSpeed ZeRO) into a Hugging Face checkpoint."""
    from quantserve.training import distributed
    from quantserve.training.config import TrainConfig

    settings = {name: value for name, value in ctx.params.items() if name in TrainConfig.field_names()}
    settings["progress"] = not quiet
    explicit = {name for name in settings if _given(ctx, name)} | ({"progress"} if _given(ctx, "quiet") else set())
    if config is not None:  # the file's values, then whatever the command line says itself
        cfg = TrainConfig.from_file(config, **{name: settings[name] for name in explicit})
    else:
        for name in ("data", "out"):
            if settings[name] is None:
                raise UsageError(f"--{name} is required (on the command line or as \"{name}\" in --config)")
        cfg = TrainConfig(**settings)
    if nproc < 1:
        raise UsageError("--nproc must be at least 1")
    if not 0 <= cfg.seed < 2**32:  # torch's range; found here, not after the model loaded
        raise UsageError(f"--seed must be between 0 and {2**32 - 1}, not {cfg.seed}")
    multi = nproc > 1 or hostfile is not None
    cfg.data, cfg.eval_data = _spool_pipe(cfg.data, multi), _spool_pipe(cfg.eval_data, multi)
    # bad requests fail here, before any process is launched; `explicit` lets it refuse an option
    # that would do nothing even where its value is the default (--lora-r 16 with --method full)
    cfg.validate(explicit)
    refuse_quantized_full(cfg.model, cfg.method)
    if (nproc > 1 or hostfile is not None) and not distributed.launched():
        argv = _strip_launch_args(sys.argv[1:])
        code = distributed.launch(argv, nproc, hostfile)  # children print nothing to stdout
        if code:
            raise UserError(f"training failed on at least one of {nproc} processes (exit code {code}); "
                            "see the messages above")
        print(cfg.out)
        return
    from quantserve.training.train import train

    try:
        path = train(cfg)
    except KeyboardInterrupt:  # Ctrl-C: say where a rerun starts
        from quantserve.training.runs import newest_saved_checkpoint

        saved = newest_saved_checkpoint(cfg.out)
        if saved is None:
            print("interrupted: no checkpoint was saved yet; the same command starts again", file=sys.stderr)
        elif cfg.force or not cfg.resume:  # these start over: say what resumes
            print(f"interrupted: the command without --force and --no-resume resumes from {saved.name}",
                  file=sys.stderr)
        else:
            print(f"interrupted: the same command resumes from {saved.name}", file=sys.stderr)
        raise
    if distributed.world()[1] == 0 and not os.environ.get("QUANTSERVE_LAUNCHED"):
        print(path)


def refuse_quantized_full(model: str, method: str) -> None:
    """A full fine-tune of a quantized checkpoint (a `convert -f bnb-*` output) fails in
    transformers only after it loaded, with the output folder already begun: refused first."""
    config = Path(model) / "config.json"
    if method != "full" or not config.is_file():
        return
    from quantserve.quant.source import read_json

    quant = read_json(config).get("quantization_config")
    if isinstance(quant, dict):
        raise UserError(f"{model} is quantized ({quant.get('quant_method', 'quantization_config')}): a full "
                        "fine-tune needs full-precision weights; use --method lora or qlora on it, or "
                        "train its fp16/fp32 source")


def _spool_pipe(path: Optional[Path], multi: bool) -> Optional[Path]:
    """A pipe (`--data <(cmd)`) can be read only once, and a run reads its data twice (the run's
    fingerprint, then the records): its content goes to a temporary file named by its hash, so a
    rerun of the same content is the same run.  Another process cannot read this one's pipe."""
    if path is None or not path.exists() or path.is_file() or path.is_dir():
        return path
    if multi:
        raise UserError(f"{path}: is a pipe, which one process reads once: --nproc/--hostfile runs need a file")
    import atexit
    import hashlib
    import tempfile

    raw = path.read_bytes()
    spooled = Path(tempfile.gettempdir()) / f"quantserve-pipe-{hashlib.sha256(raw).hexdigest()[:16]}.jsonl"
    spooled.write_bytes(raw)
    atexit.register(spooled.unlink, missing_ok=True)
    return spooled


def _given(ctx: typer.Context, name: str) -> bool:
    """Did the command line (or an environment variable) set this option?  By the source's name:
    typer carries its own copy of click, whose ParameterSource is not click's."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _strip_launch_args(argv: list[str]) -> list[str]:
    """The command line minus --nproc/--hostfile, so the launched copies do not launch again."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--nproc", "--hostfile"):
            skip = True
            continue
        if a.startswith(("--nproc=", "--hostfile=")):
            continue
        out.append(a)
    return out


def plan_command(
    model: str = typer.Option("default", help="Checkpoint folder, a config.json, or a shape name (llama-3.2-1b, llama-3.1-8b, ...)."),
    seq_len: int = typer.Option(..., help="Tokens per sequence."),
    micro_batch: int = typer.Option(1, help="Sequences per GPU per step."),
    gpu: Optional[str] = typer.Option(None, help="t4 | a10g | l4 | a100-40g | a100-80g | h100 | h200."),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GPU memory in GiB (instead of --gpu)."),
    gpus: int = typer.Option(1, help="Data-parallel GPUs."),
    method: Optional[str] = typer.Option(None, help="Only this method (full | lora | qlora); default: all."),
    liger: Optional[bool] = typer.Option(None, "--liger/--no-liger", help="Count Liger's kernels (default: where the GPU supports them)."),
    accumulate: bool = typer.Option(True, "--accumulate/--no-accumulate", help="Gradient accumulation over micro-batches (ZeRO-1/2 then hold fp32 gradients through the backward)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Memory arithmetic per setup (ZeRO 0-3, offload, LoRA/QLoRA, checkpointing) and the one that fits."""
    from quantserve.training.plan import plan, print_report

    report = plan(model=model, seq_len=seq_len, micro_batch=micro_batch, gpu=gpu, gpu_mem_gib=gpu_mem,
                  gpus=gpus, method=method, liger=liger, accumulate=accumulate)
    if as_json:
        import json

        print(json.dumps(report.as_dict(), indent=1))
    else:
        print_report(report)
