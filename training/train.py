"""The fine-tuning recipe: `train(TrainConfig) -> Path`, read top to bottom.

1. check the request against the machine (dtype, attention, Liger, sequence length) and the data
   (every line parsed and tokenized) before any model or GPU memory exists;
2. build TrainingArguments with a DeepSpeed config from the presets (when `zero` is set), then fix
   accelerate's view of the process group so each rank gets its own shard of the data;
3. load the model (partitioned at load under ZeRO-3), patch it (Liger, checkpointing, LoRA);
4. train with the Hugging Face Trainer, resuming from the last checkpoint in `out` if any;
5. save a normal Hugging Face checkpoint (ZeRO-3 gathered to 16 bit; LoRA as adapter, merged on
   request), `train_log.json` and `loss.png`.

Not supported, loudly: QLoRA with ZeRO-3, parameter offload without ZeRO-3, FlashAttention-2 on
a GPU older than Ampere, bf16 on a T4; each is refused with the reason before anything loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from quantserve.settings import UserError, make_readable
from quantserve.training import distributed
from quantserve.training.distributed import log
from quantserve.training.runs import (RUN_FILE, data_fingerprint, finished_run, is_run_folder,
                                      last_complete_checkpoint, other_run, run_identity)
from quantserve.training.config import ATTN_IMPL, SCHEDULES, Resolved, TrainConfig

PROBE_PROMPT = "Reverse: a b c d"
MAX_DEFAULT_SEQ = 2048


def resolve(cfg: TrainConfig, caps, model_config) -> Resolved:
    """Decide dtype, attention and Liger for this machine; refuse what cannot run."""
    from quantserve.capabilities import check_dtype

    ws, rank, local = distributed.world()
    notes = []
    dtype = {"auto": caps.dtype, "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[cfg.dtype]
    check_dtype(caps, dtype)
    if caps.device == "cpu" and dtype == "float16":
        raise UserError("fp16 training needs a CUDA GPU; on the CPU use --dtype fp32 (or auto)")
    if cfg.method == "qlora" and caps.packages.get("bitsandbytes") is None:
        raise UserError("QLoRA needs bitsandbytes: pip install 'quantserve[quant]'")
    if cfg.zero is not None and caps.packages.get("deepspeed") is None:
        raise UserError("--zero needs DeepSpeed: pip install 'quantserve[train]'")

    if cfg.attn == "auto":
        attention = caps.attention
    else:
        attention = ATTN_IMPL[cfg.attn]
        if attention == "flash_attention_2" and caps.attention != "flash_attention_2":
            why = "flash-attn is not installed" if caps.packages.get("flash_attn") is None else \
                f"it needs compute capability >= 8.0 (this run: {caps.gpu_name or 'CPU'}, profile {caps.profile})"
            raise UserError(f"--attn flash2 cannot run here: {why}; use --attn sdpa")

    if caps.liger and cfg.liger is not False:
        liger, why = True, "on"
    elif cfg.liger is False:
        liger, why = False, "off (--no-liger)"
    else:
        liger = False
        why = ("off: liger-kernel is not installed" if caps.packages.get("liger_kernel") is None
               else "off: its Triton kernels need a CUDA GPU")
        if cfg.liger:
            notes.append(f"--liger asked for but Liger is {why}; training without it")

    limit = getattr(model_config, "max_position_embeddings", None)
    if cfg.seq_len is not None and limit is not None and cfg.seq_len > limit:
        raise UserError(f"--seq-len {cfg.seq_len} is over the model's limit of {limit} positions")
    return Resolved(device=caps.device, dtype=dtype, attention=attention, liger=liger, liger_reason=why,
                    world_size=ws, rank=rank, local_rank=local, notes=notes)


def set_threads(cfg: TrainConfig, caps, world_size: int) -> None:
    """CPU threads per process.  OpenMP threads spin-wait, so on cores shared with other ranks or
    other work, one thread per process is many times faster (measured ~30x on a loaded 2-core
    host) than oversubscribing them."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
        return
    if caps.device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    cores = os.cpu_count() or 1
    if world_size > 1:
        torch.set_num_threads(max(1, cores // world_size))
    elif os.getloadavg()[0] > 0.75 * cores:
        torch.set_num_threads(1)


def training_args(cfg: TrainConfig, res: Resolved):
    from transformers import TrainingArguments

    ds = None
    if cfg.zero is not None:
        from quantserve.training.ds_config import build

        ds = build(cfg.zero, cfg.offload, res.dtype, t4=res.device == "cuda" and cfg_profile(cfg) == "t4")
    return TrainingArguments(
        output_dir=str(cfg.out),
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.accumulation(res.world_size),
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps or -1,
        learning_rate=cfg.lr,
        lr_scheduler_type=SCHEDULES[cfg.lr_schedule],
        warmup_steps=cfg.warmup_ratio,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        optim="adamw_torch",
        fp16=res.dtype == "float16",
        bf16=res.dtype == "bfloat16",
        deepspeed=ds,
        # Plain multi-process runs on a CPU need accelerate's CPU mode to form a gloo group;
        # under DeepSpeed the group comes from deepspeed.comm instead.
        use_cpu=res.device == "cpu" and cfg.zero is None,
        ddp_backend="gloo" if res.device == "cpu" and res.world_size > 1 else None,
        # Every parameter that trains takes part in each forward (full, LoRA and QLoRA alike), so
        # DDP's search for unused ones is wasted work, and it warns so on every rank each run.
        ddp_find_unused_parameters=False,
        logging_steps=cfg.logging_steps,
        # 0: no resumable checkpoints (a DeepSpeed one holds the optimizer state: 12+ bytes/param)
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=max(cfg.save_steps, 1),
        save_total_limit=cfg.save_total_limit,
        seed=cfg.seed,
        data_seed=cfg.seed,
        report_to="none",
        disable_tqdm=True,  # our own progress bar shows tokens/s
        include_num_input_tokens_seen="non_padding",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=res.device == "cuda",  # pinned memory needs a GPU (a warning per run without)
    )


def cfg_profile(cfg: TrainConfig) -> str:
    from quantserve.capabilities import resolve_profile

    return resolve_profile(cfg.gpu_profile)


def train(cfg: TrainConfig) -> Path:
    """Fine-tune `cfg.model` on `cfg.data`; return `cfg.out`, a loadable Hugging Face checkpoint."""
    # stdout carries only what the caller prints (the CLI: the output path); libraries print
    # there too (DeepSpeed: "... built successfully" when it builds an op), so they get stderr,
    # from the first process only (every rank prints them: the log would say each twice)
    first = os.environ.get("RANK", "0") == "0"
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(sys.stderr if first else devnull):
        return _train(cfg)


def _train(cfg: TrainConfig) -> Path:
    cfg.validate()
    identity = run_identity(cfg)  # hashes the data file: once
    done = finished_run(cfg, identity)
    if done is not None:
        log(f"already trained: {cfg.out} holds a finished run of this config ({done} steps); "
            "nothing to do (--force retrains)")
        return cfg.out
    other = other_run(cfg, identity)
    if other and not cfg.force:
        # resuming its checkpoint would train the old run on (with max_steps reached, not at all)
        # and leave its model under the new command's name
        raise UserError(f"{cfg.out} holds a run of another config ({other}); pass --force to replace "
                        "it, or choose another --out")
    if cfg.out.is_dir() and not is_run_folder(cfg.out) and not cfg.force:
        raise UserError(f"{cfg.out} holds other files and no training run ({RUN_FILE}); pass --force to train "
                        "into it anyway, or choose another --out")
    if cfg.force and cfg.out.is_dir():
        for old in cfg.out.glob("checkpoint-*"):
            shutil.rmtree(old, ignore_errors=True)  # a forced run starts over, never resumes
    t_start = time.time()
    import torch

    torch.set_grad_enabled(True)  # an evaluation earlier in the same process may have left it off
    if cfg.zero is not None:
        distributed.single_process_env()
    ws, rank, _ = distributed.world()
    import torch
    from transformers import AutoConfig, PrinterCallback, Trainer, set_seed

    from quantserve.capabilities import apply_profile, detect
    from quantserve.modeling import load_tokenizer
    from quantserve.settings import resolve_checkpoint
    from quantserve.training import data as data_mod
    from quantserve.training.callbacks import MemoryCallback, ProgressCallback, StepLogCallback, write_log
    from quantserve.training.loading import (check_lora_targets, check_model, load_for_training,
                                             trainable_summary, undo_liger_globals)

    caps = detect(cfg.gpu_profile)
    set_threads(cfg, caps, ws)
    model_path = resolve_checkpoint(cfg.model, progress=cfg.progress and rank == 0)
    check_model(model_path)
    model_config = AutoConfig.from_pretrained(str(model_path))
    if cfg.plan == "auto":
        cfg = apply_auto_plan(cfg, model_config, caps, ws)
    res = resolve(cfg, caps, model_config)
    cfg.accumulation(res.world_size)  # a global batch the ranks cannot split fails here
    check_lora_targets(cfg, model_config)
    seq_len = cfg.seq_len or min(getattr(model_config, "max_position_embeddings", MAX_DEFAULT_SEQ), MAX_DEFAULT_SEQ)

    tok = load_tokenizer(model_path)
    records = data_mod.read_jsonl(cfg.data, cfg.skip_bad_lines)
    dataset = data_mod.TokenDataset(data_mod.encode(tok, records, seq_len, cfg.packing))
    eval_items = None
    if cfg.eval_data is not None:
        from quantserve.training.eval_gate import read_eval_items

        eval_items = read_eval_items(cfg.eval_data)  # a bad file fails before the model loads
    log(f"setup: {cfg.method}, ZeRO {cfg.zero if cfg.zero is not None else 'off'}"
        f"{' + offload ' + cfg.offload if cfg.offload != 'none' else ''}, {ws} process(es), "
        f"{res.device} {res.dtype}, attention {res.attention}, Liger {res.liger_reason}, "
        f"checkpointing {'on' if cfg.grad_ckpt else 'off'}")
    log(f"data: {len(records)} records -> {len(dataset)} examples, {dataset.tokens():,} tokens "
        f"(seq-len {seq_len}{', packed' if cfg.packing else ', padding-free where cheaper' if cfg.padding_free else ''})")
    for note in res.notes:
        log(f"note: {note}")

    # From here on memory is touched.
    apply_profile(caps)
    set_seed(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # what this folder's checkpoints belong to (other_run reads it)
        (cfg.out / RUN_FILE).write_text(json.dumps(identity, indent=1))
    args = training_args(cfg, res)
    _ = args.device  # builds accelerate's state (and DeepSpeed's process group)
    distributed.fix_accelerate_state(args)
    model = load_for_training(model_path, cfg, res)
    trainable, total = trainable_summary(model)
    log(f"model: {total / 1e6:.2f} M parameters, {trainable / 1e6:.3f} M trainable")

    collator = data_mod.Collator(tok.pad_token_id, seq_len, padding_free=cfg.padding_free and not cfg.packing,
                                 hidden_size=getattr(model_config, "hidden_size", 0),
                                 attention=res.attention)
    if cfg.audit_data:
        collator.seen = []
    memory = MemoryCallback()
    gate = None
    if cfg.eval_data is not None:
        from quantserve.training.eval_gate import ExactMatchGate

        gate = ExactMatchGate(eval_items, tok, cfg.eval_steps, cfg.stop_at_exact_match, cfg.gate_cooldown)
    callbacks = [StepLogCallback(), ProgressCallback(cfg.progress, gate), memory] + ([gate] if gate else [])
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                      processing_class=tok, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # our ProgressCallback replaces its dict printing
    last = last_complete_checkpoint(cfg.out) if cfg.resume and cfg.out.is_dir() else None
    if last:
        log(f"resuming from {last}")
    try:
        result = trainer.train(resume_from_checkpoint=last)
        probe = probe_logits(trainer.model, tok, res)
        save(trainer, tok, cfg, res, model_path)
    finally:
        undo_liger_globals()  # models loaded later in this process must not inherit Liger's kernels

    gpu_memory = distributed.gather(memory.report())  # collective: every rank takes part
    if collator.seen is not None:
        (cfg.out / "data_audit").mkdir(exist_ok=True)
        (cfg.out / "data_audit" / f"rank{rank}.json").write_text(json.dumps(collator.seen))
    if trainer.is_world_process_zero():
        summary = {
            "config": cfg.as_dict(), "data_fingerprint": data_fingerprint(cfg.data),
            "resolved": res.__dict__, "model_path": str(model_path),
            "world_size": ws, "method": cfg.method, "zero": cfg.zero,
            "global_step": trainer.state.global_step, "resumed_from": last,
            "train_loss": result.training_loss, "tokens_seen": int(trainer.state.num_input_tokens_seen),
            "examples": len(dataset), "seconds": round(time.time() - t_start, 1),
            "trainable_params": trainable, "params": total, "probe": probe, "gpu_memory": gpu_memory,
            "eval": [e for e in trainer.state.log_history if "eval_exact_match" in e],
        }
        write_log(cfg.out, trainer.state.log_history, summary)
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        if losses:
            log(f"done: {trainer.state.global_step} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                f"{summary['seconds']} s; checkpoint in {cfg.out}, curve in {cfg.out / 'loss.png'}")
        peaks = [m["peak_gib"] for m in gpu_memory if m["peak_gib"] is not None]
        if summary["eval"]:
            last = summary["eval"][-1]
            goal = cfg.stop_at_exact_match
            verdict = "" if goal is None else (" (target reached)" if last["eval_exact_match"] >= goal else
                                               f" (target {goal:.0%} NOT reached within the step bound)")
            log(f"eval: exact match {last['eval_exact_match']:.1%} at step {last['step']}{verdict}")
        if peaks:
            log(f"GPU memory: peak {' / '.join(f'{p:.2f}' for p in peaks)} GiB per rank")
    distributed.barrier()
    return cfg.out


def probe_logits(model, tok, res: Resolved) -> dict:
    """Last-position logits of the trained in-memory model on a fixed prompt.

    Tests compare them with the saved checkpoint's, which proves the save (ZeRO-3 gather, LoRA
    merge) wrote the weights that were actually trained.  Every rank runs the forward: under
    ZeRO-3 the parameters are gathered collectively.
    """
    import torch

    from quantserve.modeling import chat_prompt

    ids = tok(chat_prompt(tok, PROBE_PROMPT), add_special_tokens=False, return_tensors="pt").input_ids
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits[0, -1].float().cpu()
    model.train(was_training)
    return {"prompt": PROBE_PROMPT, "input_ids": ids[0].tolist(), "last_logits": [round(x, 5) for x in logits.tolist()]}


def save(trainer, tok, cfg: TrainConfig, res: Resolved, base_path: Path) -> None:
    """Write the final checkpoint into `cfg.out` (next to the Trainer's `checkpoint-N` folders)."""
    if cfg.method == "full":
        trainer.save_model(str(cfg.out))  # ZeRO-3: gathers the 16-bit weights on rank 0
    elif not cfg.merge:
        trainer.save_model(str(cfg.out))  # peft writes adapter_config.json + adapter_model.safetensors
    else:
        adapter = cfg.out / "adapter"
        trainer.save_model(str(adapter))
        distributed.barrier()
        if trainer.is_world_process_zero():
            merge_adapter(base_path, adapter, cfg.out, res)
    if trainer.is_world_process_zero():
        tok.save_pretrained(str(cfg.out))
        make_readable(cfg.out)
    distributed.barrier()


def merge_adapter(base_path: Path, adapter: Path, out: Path, res: Resolved) -> None:
    """Fold the LoRA weights into a fresh 16-bit (fp32 on a CPU) copy of the base model.

    QLoRA adapters are merged into the unquantized base, not the NF4 one: merging into 4-bit
    weights would round the update away.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from quantserve.capabilities import torch_dtype

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch_dtype(res.dtype), use_safetensors=True)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    for stale in ("adapter_config.json", "adapter_model.safetensors"):
        if (out / stale).exists():
            os.remove(out / stale)


def apply_auto_plan(cfg: TrainConfig, model_config, caps, world_size: int) -> TrainConfig:
    """`--plan auto`: take ZeRO stage, offload, checkpointing and micro-batch from the planner."""
    from quantserve.training.plan import plan_for_config

    if caps.memory_budget_gib is None:
        raise UserError("--plan auto sizes the setup to a GPU's memory and this run has no GPU: "
                        "choose --zero/--offload/--grad-ckpt yourself (`quantserve plan` shows the arithmetic)")
    seq = cfg.seq_len or min(getattr(model_config, "max_position_embeddings", MAX_DEFAULT_SEQ), MAX_DEFAULT_SEQ)
    report = plan_for_config(model_config, seq_len=seq, micro_batch=cfg.micro_batch, gpus=world_size,
                             gpu_mem_gib=caps.memory_budget_gib, method=cfg.method,
                             liger=caps.liger and cfg.liger is not False,
                             accumulate=cfg.accumulation(world_size) > 1, bf16=caps.dtype == "bfloat16")
    best = report.best
    if best is None:
        raise UserError(f"no setup fits: {report.why_none}")
    log(f"plan auto: {best.name} (predicted peak {best.peak_gib:.2f} GiB of {report.budget_gib:.1f} GiB)")
    if best.offload != "none":
        log("plan auto: offload chosen as the last resort; expect steps several times slower")
    return replace(cfg, zero=best.zero, offload=best.offload, grad_ckpt=best.grad_ckpt, plan=None)
