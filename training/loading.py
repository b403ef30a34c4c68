"""Loading the model to train: precision, attention backend, Liger, checkpointing, LoRA / QLoRA.

Order matters and follows the libraries' own recipes:
1. weights load (under ZeRO-3 the Trainer's DeepSpeed config is already alive, so transformers
   partitions them at load with `zero.Init` instead of materialising the full model per rank);
2. Liger patches the model instance, as `AutoLigerKernelForCausalLM` does at load;
3. activation checkpointing (non-reentrant, which also works for LoRA's frozen inputs);
4. peft wraps it; adapter weights stay fp32 (peft's `autocast_adapter_dtype`), so fp16 loss
   scaling can unscale their gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

from quantserve.settings import UserError
from quantserve.training.config import Resolved, TrainConfig


def enable_checkpointing(model) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


# Liger patches more than the instance: names in the model's modeling module (e.g.
# modeling_llama.apply_rotary_pos_emb, LlamaRMSNorm) and, for its plain cross-entropy, torch's own
# F.cross_entropy.  Every model built later in the process would then run Triton kernels, and one
# on the CPU (the evaluation after a fine-tune) fails.  `undo_liger_globals` puts them back.
_liger_saved: list[tuple[object, dict]] = []


def apply_liger(model, zero: int | None) -> None:
    """Patch RMSNorm/RoPE/SwiGLU with Liger's Triton kernels and fuse lm_head + cross-entropy.

    Under ZeRO-3 the lm_head weight is a partitioned placeholder outside its module's forward,
    so the fused linear cross-entropy (which reads it directly) is left off there.
    """
    import sys

    import torch.nn.functional as F
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _liger_saved.append((sys.modules[type(model).__module__], dict(vars(sys.modules[type(model).__module__]))))
    _liger_saved.append((F, {"cross_entropy": F.cross_entropy}))
    fused = zero != 3
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True,
                                    cross_entropy=not fused, fused_linear_cross_entropy=fused)


def undo_liger_globals() -> None:
    """Restore what `apply_liger` changed outside the model instances (which keep their kernels)."""
    while _liger_saved:
        owner, saved = _liger_saved.pop()
        for name, value in saved.items():
            if getattr(owner, name, None) is not value:
                setattr(owner, name, value)


def check_model(path: Path) -> None:
    """One clear line for a checkpoint that cannot be trained, before the data is read or anything
    loads: weights that are pickles, an architecture that is not a causal LM (a BERT would
    otherwise fail on its tokenizer's missing chat template), a safetensors file cut short (named
    here; safetensors' own error does not say which file).  The checks `quant convert` runs."""
    from quantserve.modeling import check_config_file, check_weights_match, require_safetensors
    from quantserve.quant.source import check_safetensors, require_causal_lm_folder, weight_files

    path = Path(path)
    if not (path / "config.json").is_file():
        return  # a LoRA adapter folder: transformers says what it needs
    check_config_file(path)  # a zero-sized field would crash transformers' own config checks
    require_safetensors(path)
    require_causal_lm_folder(path)
    files = weight_files(path)
    for f in files:
        check_safetensors(f)  # the header and the length only: no weights are read
    check_weights_match(path, files)  # else transformers initialises what does not fit at random


def lora_target_names(cfg: TrainConfig) -> str | list[str]:
    """--lora-targets as peft takes it: "all-linear", or a list of module names."""
    if cfg.lora_targets == "all-linear":
        return "all-linear"
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]


def check_lora_targets(cfg: TrainConfig, model_config) -> None:
    """Every --lora-targets name must match a linear layer of the model, checked on a weightless
    (meta-device) copy before anything loads: peft raises its own error class only when no name
    matches, and silently leaves out a name that does not match when another one does."""
    if cfg.method == "full":
        return
    targets = lora_target_names(cfg)
    if targets == "all-linear":
        return
    if not targets:
        raise UserError("--lora-targets names no module: give comma-separated names, or all-linear")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    linear = [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))]
    for t in targets:  # peft's rule for a list: the full name, or its last dotted parts
        if not any(name == t or name.endswith("." + t) for name in linear):
            names = sorted({name.rsplit(".", 1)[-1] for name in linear})
            raise UserError(f"--lora-targets {t!r} matches no linear layer of this model; its linear "
                            f"layers: {', '.join(names)} (or all-linear)")


def load_for_training(path: Path, cfg: TrainConfig, res: Resolved):
    import torch
    from transformers import AutoModelForCausalLM

    from quantserve.capabilities import torch_dtype
    from quantserve.modeling import check_loading_info, require_safetensors

    require_safetensors(Path(path))  # one clear line for a pickle-only checkpoint, not a traceback
    compute = torch_dtype(res.dtype)
    kwargs: dict = {"attn_implementation": res.attention}
    if cfg.method == "full":
        # Full fine-tunes keep fp32 weights: mixed precision (amp or DeepSpeed's fp16/bf16
        # engine) computes in 16 bit and needs fp32 master weights for the optimizer.
        kwargs["dtype"] = torch.float32
    elif cfg.method == "lora":
        kwargs["dtype"] = compute
    else:
        from transformers import BitsAndBytesConfig

        kwargs["dtype"] = compute
        # Double quantization: the form that survives save -> reload (GUIDE: 4-bit without it did not).
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute)
        if res.device == "cuda":
            kwargs["device_map"] = {"": res.local_rank}
    kwargs["output_loading_info"] = True  # transformers only prints what it initialised at random
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **kwargs)
    except ValueError as e:  # e.g. Gemma 2 (soft-capped scores): transformers refuses SDPA for it
        if "does not support an attention implementation" not in str(e) or res.attention == "eager":
            raise
        if cfg.attn != "auto":
            raise UserError(f"{path}: transformers does not run this architecture with --attn {cfg.attn}; "
                            "use --attn eager (or auto)") from None
        print(f"attention: {res.attention} is not supported for this architecture by transformers; eager",
              file=sys.stderr, flush=True)
        kwargs["attn_implementation"] = res.attention = "eager"
        model, info = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **kwargs)
    check_loading_info(Path(path), info)
    return prepare(model, cfg, res)


def prepare(model, cfg: TrainConfig, res: Resolved):
    """Everything after the weights are in memory (also used by the benchmark on random weights)."""
    model.config.use_cache = False
    if res.liger:
        apply_liger(model, cfg.zero)
    if cfg.grad_ckpt:
        enable_checkpointing(model)
    if cfg.method in ("lora", "qlora"):
        model = wrap_lora(model, cfg)
    return model


def wrap_lora(model, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    if cfg.method == "qlora" and cfg.grad_ckpt:
        # What peft's prepare_model_for_kbit_training does for checkpointing, without its cast of
        # every non-quantized weight to fp32 (gigabytes of embeddings and lm_head on an 8B model).
        model.enable_input_require_grads()
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=lora_target_names(cfg), task_type="CAUSAL_LM")
    return get_peft_model(model, lora, autocast_adapter_dtype=True)


def trainable_summary(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; under ZeRO-3 a parameter's own tensor is an empty
    placeholder and `ds_numel` is its real size."""
    def size(p):
        return getattr(p, "ds_numel", p.numel())

    params = list(model.parameters())
    return sum(size(p) for p in params if p.requires_grad), sum(size(p) for p in params)
