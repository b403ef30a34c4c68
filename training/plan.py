"""Memory arithmetic for a training setup, and the setup that fits: `quantserve plan`.

Per GPU, in bytes, for Ψ parameters, T = micro-batch x seq-len tokens and L layers:

- model states (ZeRO paper, mixed-precision Adam): 16-bit weights 2Ψ, 16-bit grads 2Ψ, fp32 master
  weights + Adam m, v 12Ψ, plus (as DeepSpeed's estimators count) the fp32 gradient partition its
  optimizer step uses, 4Ψ.  ZeRO-1 splits the 12Ψ + 4Ψ over N GPUs, ZeRO-2 also the 16-bit grads,
  ZeRO-3 also the weights; optimizer offload moves the 12Ψ to CPU RAM, parameter offload the rest.  Without
  DeepSpeed the Trainer keeps fp32 weights and grads and runs autocast (4Ψ + 4Ψ + 8Ψ).
  LoRA: frozen 16-bit base (2Ψ) + fp32 adapters with full Adam state (16 bytes each); QLoRA:
  NF4 base with double quantization (~0.52 bytes per quantized weight, the rest 16-bit).
- activations, per token per layer: what autograd saves in Hugging Face's Llama with fused SDPA
  attention (no s^2 score matrix), measured by counting saved tensors on a CPU:
  autocast over fp32 weights 32h + 11I + 6kv, 16-bit weights 20h + 8I + 4kv (h hidden, I MLP
  width, kv = KV heads x head dim).  Eager attention adds Korthikanti's 5·a·s (scores, softmax,
  its dropout-free copy) per token per layer.  Checkpointing keeps the layer inputs (4h or 2h) and
  one layer's activations while it is recomputed.  Liger's RMSNorm/SwiGLU save less (~-6h, -5I/-2I).
- logits: ~12·V bytes per token at the loss (16-bit logits, their fp32 copy, log-softmax and its
  gradient); Liger's fused linear cross-entropy never builds them (~8h per token + lm_head grad).

- autocast over fp32 weights also holds a 16-bit copy of each matmul weight for the step (2 bytes
  per linear parameter, lm_head included).

Peak = weights + optimizer + max(activations + logits + buffers, grads) without DeepSpeed and for
ZeRO-3; ZeRO-1/2 allocate their gradient partition up front, so there it adds instead of max.
Checked against the GPU (bench/RESULTS.md): every row of the training benchmark within ±11 %.: the forward/backward
peak comes with the activations, the optimizer-step peak with all gradients (fused AdamW).
DeepSpeed's own estimators (`estimate_zero2/3_model_states_mem_needs`) are shown next to ours.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantserve.settings import UsageError, UserError

GIB = 2**30
# Usable memory (GiB) of common GPUs: total minus CUDA context and allocator slack.
GPUS = {"t4": 15.0, "a10g": 22.0, "l4": 22.0, "a100-40g": 38.0, "a100-80g": 78.0, "h100": 78.0, "h200": 138.0}
SHAPES = {  # public architecture shapes (LlamaConfig kwargs); weights are never needed to plan
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         tie_word_embeddings=False),
}
NF4_BYTES = 0.5 + 0.127 / 8 + 0.5 / 64  # 4-bit codes + double-quantized absmax per 64-block
BUCKETS = 2 * 5e7 * 2  # DeepSpeed's allgather + reduce buckets of 5e7 16-bit elements
SPEED = {"none": 1.0, "optimizer": 4.0, "all": 8.0}  # rough step-time factors, for ranking only


@dataclass
class Shape:
    params: int  # Ψ
    layer_linear: int  # weights of the linear layers inside the blocks (what QLoRA quantizes)
    lora_params: int  # adapter weights for all-linear LoRA at rank 16
    largest_layer: int
    hidden: int
    inter: int
    kv: int
    heads: int
    layers: int
    vocab: int
    max_positions: int

    @classmethod
    def from_config(cls, c, lora_r: int = 16) -> "Shape":
        h, inter, L, a = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or a
        hd = getattr(c, "head_dim", None) or h // a
        q, kv = a * hd, kv_heads * hd
        mats = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
        per_layer = sum(i * o for i, o in mats)
        emb = c.vocab_size * h
        tied = getattr(c, "tie_word_embeddings", False)
        params = L * (per_layer + 2 * h) + emb * (1 if tied else 2) + h
        return cls(params=params, layer_linear=L * per_layer, lora_params=L * sum(lora_r * (i + o) for i, o in mats),
                   largest_layer=max(per_layer, emb), hidden=h, inter=inter, kv=kv, heads=a, layers=L,
                   vocab=c.vocab_size, max_positions=getattr(c, "max_position_embeddings", 0))


# What Shape.from_config reads: a decoder-only transformer's config, under transformers' Llama names
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def require_decoder_only(config, label: str) -> None:
    """One line for a config the arithmetic does not describe (an encoder-decoder such as T5, an
    encoder such as BERT), naming the fields it lacks, instead of an AttributeError or a made-up table."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = (getattr(config, "architectures", None) or [None])[0]
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("is an encoder-decoder model" + (f" ({arch})" if arch else ""))
    elif arch and arch not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        problems.append(f"describes a {arch}, not a causal LM")
    missing = [name for name in SHAPE_FIELDS if getattr(config, name, None) is None]
    if missing:
        problems.append(f"has no {', '.join(missing)}")
    if problems:
        raise UserError(f"{label}: {type(config).__name__} {' and '.join(problems)}; the planner handles "
                        f"decoder-only causal LM configs ({', '.join(SHAPE_FIELDS)})")


@dataclass
class Row:
    name: str
    method: str
    zero: int | None
    offload: str
    grad_ckpt: bool
    liger: bool
    weights: float  # bytes per GPU
    grads: float
    optimizer: float
    activations: float
    logits: float
    peak: float
    cpu: float  # host RAM for offloaded states
    ds_estimate: float | None  # DeepSpeed's own model-states estimate (GPU bytes), where it has one
    fits: bool = False
    note: str = ""

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB


@dataclass
class Report:
    model: str
    seq_len: int
    micro_batch: int
    gpus: int
    budget_gib: float | None
    params: int
    rows: list[Row] = field(default_factory=list)
    best: Row | None = None
    why_none: str = ""

    def as_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k not in ("rows", "best")},
                "rows": [asdict(r) for r in self.rows], "best": asdict(self.best) if self.best else None}


def activation_bytes(s: Shape, tokens: int, seq_len: int, amp: bool, ckpt: bool, liger: bool,
                     eager: bool = False) -> float:
    """Saved activations of all layers for `tokens` tokens (see the module docstring)."""
    h, i, kv = s.hidden, s.inter, s.kv
    if amp:  # fp32 residual stream under autocast
        per = 32 * h + 11 * i + 6 * kv - ((6 * h + 5 * i) if liger else 0)
        keep = 4 * h
    else:
        per = 20 * h + 8 * i + 4 * kv - ((6 * h + 2 * i) if liger else 0)
        keep = 2 * h
    per += 6 * s.heads + (5 * s.heads * seq_len if eager else 0)
    if ckpt:
        return tokens * (s.layers * keep + per)
    return tokens * s.layers * per


def logits_bytes(s: Shape, tokens: int, liger: bool, weight_bytes: int) -> float:
    if liger:
        return tokens * 8 * s.hidden + s.vocab * s.hidden * weight_bytes
    return tokens * 12 * s.vocab


def setup_row(s: Shape, method: str, zero: int | None, offload: str, ckpt: bool, liger: bool,
              tokens: int, seq_len: int, n: int, dtype_bytes: int = 2, accumulate: bool = True,
              bf16: bool = False) -> Row:
    """Memory of one setup on each of `n` GPUs.

    `accumulate`: gradients are accumulated over several micro-batches per optimizer step;
    `bf16`: bf16 rather than fp16 (loss-scaled) mixed precision.  Both matter to ZeRO-1/2 only."""
    P = s.params
    cpu = 0.0
    ds_est = None
    if method == "full":
        if dtype_bytes == 4 or zero is None:  # autocast over fp32 weights (or plain fp32)
            w, g, o, amp = 4 * P, 4 * P, 8 * P, dtype_bytes != 4
        else:
            # DeepSpeed also keeps an fp32 copy of each rank's gradient partition for the step
            # (as its estimators count): 12 + 4 bytes of optimizer-side state per parameter.
            w, g, o, amp = 2 * P, 2 * P, 16 * P, False
            if zero >= 1:
                o = 16 * P / n
            if zero >= 2:
                g = 2 * P / n
            if zero == 3:
                w = 2 * P / n + 4 * s.largest_layer  # + the gathered layer being computed
                g = 0.0  # reduced straight into the fp32 partition (only buckets stay in 16 bit)
            if offload in ("optimizer", "all"):
                cpu += 12 * P / n + 4 * P / n
                o = 0.0
                if zero == 3:
                    g = 0.0
                # ZeRO-1/2 still reduce each rank's 16-bit gradient partition on the GPU before
                # copying it to the CPU (measured: 2 bytes/param more than the states alone)
            if offload == "all":
                cpu += 2 * P / n
                w = 4 * s.largest_layer
            ds_est = _ds_estimate(s, zero, offload, n)
        weight_bytes = 4 if (dtype_bytes == 4 or zero is None) else 2
    else:
        base = 2 * P if method == "lora" else NF4_BYTES * s.layer_linear + 2 * (P - s.layer_linear)
        if dtype_bytes == 4:
            base = 4 * P
        a = s.lora_params
        w, g, o, amp = base + 4 * a, 4 * a, 8 * a, False
        if zero == 3:
            w = base / n + 4 * s.largest_layer + 4 * a
        weight_bytes = dtype_bytes
    act = activation_bytes(s, tokens, seq_len, amp, ckpt, liger)
    logit = logits_bytes(s, tokens, liger, weight_bytes)
    buffers = BUCKETS if zero is not None and zero >= 1 else 0.0
    if amp:
        # autocast caches a 16-bit copy of every weight a matmul uses (the blocks' linears and
        # lm_head) until the forward ends, and the backward keeps them as saved tensors
        buffers += 2 * (s.layer_linear + s.vocab * s.hidden)
    if zero in (1, 2):
        # DeepSpeed allocates the gradient partition up front and it lives through the backward,
        # next to the activations (the Trainer without DeepSpeed grows .grad as activations free).
        # Its fp32 copy (4 of the 16 optimizer-side bytes) lives there too under fp16, or when bf16
        # gradients are accumulated in fp32 over micro-batches; otherwise only during the step
        # (measured on 2 GPUs, bench/RESULTS.md: ZeRO-2 with and without accumulation).
        fp32_grads = 4 * P / n if o else 0.0  # part of `o`
        held_in_backward = o if (accumulate or not bf16) else o - fp32_grads
        peak = max(w + held_in_backward + g + act + logit + buffers, w + o + g + buffers)
    else:
        peak = w + o + max(act + logit + buffers, g)
    parts = [method]
    if zero is not None:
        parts.append(f"zero{zero}" + (f"+offload-{offload}" if offload != "none" else ""))
    if ckpt:
        parts.append("ckpt")
    if liger:
        parts.append("liger")
    return Row("/".join(parts), method, zero, offload, ckpt, liger, w, g, o, act, logit, peak, cpu, ds_est)


def _ds_estimate(s: Shape, zero: int, offload: str, n: int) -> float | None:
    """DeepSpeed's own model-states estimate for the GPU (bytes), or None before ZeRO-2."""
    import contextlib
    import sys

    try:
        # DeepSpeed's logger writes to stdout at import; keep stdout for the table / JSON.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401

        if zero == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            return float(estimate_zero2_model_states_mem_needs(s.params, n, 1, offload != "none")[1])
        if zero == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            return float(estimate_zero3_model_states_mem_needs(
                s.params, s.largest_layer, n, 1, offload != "none", offload == "all")[1])
    except ImportError:
        return None
    return None


def load_shape(model: str) -> tuple[str, object]:
    """A shape name, a checkpoint folder or a config.json → (label, transformers config)."""
    p = Path(model)
    known = model.lower() in SHAPES or model == "default" or (p.is_file() and p.suffix == ".json") or \
        (p.is_dir() and (p / "config.json").is_file())
    if not known:  # said before transformers is imported (seconds)
        raise UserError(f"--model {model!r}: not a shape ({', '.join(SHAPES)}), a checkpoint folder or a config.json")
    from transformers import AutoConfig, LlamaConfig

    if model.lower() in SHAPES:
        return model.lower(), LlamaConfig(**SHAPES[model.lower()])
    if model == "default":
        from quantserve.settings import resolve_checkpoint

        return "default", AutoConfig.from_pretrained(str(resolve_checkpoint("default", progress=False)))
    from quantserve.modeling import check_config, check_config_file

    if p.is_file() and p.suffix == ".json":
        try:
            values = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{p}: not valid JSON ({e})") from e
        check_config(values, p)  # an object, its sizes positive (a zero head count divided by, once)
        return model, AutoConfig.for_model(**values)
    if p.is_dir() and (p / "config.json").is_file():
        check_config_file(p)
        return model, AutoConfig.from_pretrained(str(p))
    raise UserError(f"--model {model!r}: not a shape ({', '.join(SHAPES)}), a checkpoint folder or a config.json")


def plan(model: str = "default", seq_len: int = 2048, micro_batch: int = 1, gpu: str | None = None,
         gpu_mem_gib: float | None = None, gpus: int = 1, method: str | None = None,
         liger: bool | None = None, accumulate: bool = True) -> Report:
    label, config = load_shape(model)
    budget = _budget(gpu, gpu_mem_gib)
    if liger is None:
        liger = gpu not in (None,) or gpu_mem_gib is not None  # a GPU is named: Liger is an option there
    bf16 = gpu is not None and gpu.lower() != "t4"  # unnamed GPUs: fp16, the larger estimate
    return plan_for_config(config, seq_len, micro_batch, gpus, budget, method, liger, label,
                           accumulate=accumulate, bf16=bf16)


def _budget(gpu: str | None, gpu_mem_gib: float | None) -> float | None:
    if gpu and gpu_mem_gib:
        raise UserError("give --gpu or --gpu-mem, not both")
    if gpu:
        if gpu.lower() not in GPUS:
            raise UsageError(f"unknown --gpu {gpu!r}; known: {', '.join(GPUS)} (or use --gpu-mem GB)")
        return GPUS[gpu.lower()]
    if gpu_mem_gib is not None and not (math.isfinite(gpu_mem_gib) and gpu_mem_gib > 0):
        raise UsageError(f"--gpu-mem must be a positive number of GiB, not {gpu_mem_gib}")
    return gpu_mem_gib


def plan_for_config(config, seq_len: int, micro_batch: int = 1, gpus: int = 1, gpu_mem_gib: float | None = None,
                    method: str | None = None, liger: bool = False, label: str = "model",
                    accumulate: bool = True, bf16: bool = False) -> Report:
    if seq_len < 1 or micro_batch < 1 or gpus < 1:
        raise UsageError("--seq-len, --micro-batch and --gpus must be at least 1")
    if method not in (None, "full", "lora", "qlora"):
        raise UsageError(f"--method must be full, lora or qlora, not {method!r}")
    require_decoder_only(config, label)
    s = Shape.from_config(config)
    if s.max_positions and seq_len > s.max_positions:
        raise UserError(f"--seq-len {seq_len} is over the model's limit of {s.max_positions} positions")
    tokens = seq_len * micro_batch
    rows = []
    for m in ([method] if method else ["full", "lora", "qlora"]):
        setups = [(None, "none")]
        if m == "full":
            setups += [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "optimizer"), (3, "all")]
        elif gpus > 1 and m == "lora":
            setups += [(2, "none"), (3, "none")]
        elif gpus > 1:
            setups += [(2, "none")]  # QLoRA x ZeRO-3 is not supported
        for zero, off in setups:
            for ckpt in (False, True):
                for lg in ([False, True] if liger else [False]):
                    rows.append(setup_row(s, m, zero, off, ckpt, lg, tokens, seq_len, gpus,
                                          accumulate=accumulate, bf16=bf16))
    report = Report(label, seq_len, micro_batch, gpus, gpu_mem_gib, s.params, rows)
    if gpu_mem_gib is not None:
        for r in rows:
            r.fits = r.peak_gib <= gpu_mem_gib
        fitting = [r for r in rows if r.fits]
        order = {"full": 0, "lora": 1, "qlora": 2}
        # Fastest first: no offload (a last resort, after every method), no checkpointing
        # (recompute costs ~1/3 more), least sharding; host RAM must hold what is offloaded.
        ram = host_ram_gib()
        fitting = [r for r in fitting if r.cpu / GIB <= ram]
        rank = lambda r: (SPEED[r.offload], order[r.method], r.grad_ckpt, (r.zero or 0) >= 3, not r.liger, r.zero or 0)
        if fitting:
            report.best = min(fitting, key=rank)
        else:
            smallest = min(rows, key=lambda r: r.peak)
            report.why_none = (f"the smallest setup ({smallest.name}) needs {smallest.peak_gib:.1f} GiB per GPU "
                               f"and the budget is {gpu_mem_gib:.1f} GiB: use more GPUs, a shorter --seq-len "
                               "or a smaller micro-batch")
    return report


def host_ram_gib() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def print_report(report: Report) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()  # the terminal's width (80 when piped): the notes wrap, the table folds
    # Never an ellipsis: at 80 columns (or piped) DeepSpeed's estimate and CPU memory make way for
    # the setup names (--json has everything); numbers and marks are never cut.
    wide = con.width >= 110
    g = lambda b: f"{b / GIB:.2f}"
    budget = f"{report.budget_gib:.1f} GiB per GPU" if report.budget_gib else "no budget given (--gpu / --gpu-mem)"
    size = f"{report.params / 1e9:.3f} B" if report.params >= 1e8 else f"{report.params / 1e6:.1f} M"
    table = Table(title=f"{report.model}: {size} params, {report.micro_batch} x {report.seq_len} "
                        f"tokens per GPU, {report.gpus} GPU(s), {budget}", box=box.SIMPLE_HEAD, padding=(0, 1))
    table.add_column("setup", overflow="fold", min_width=16)
    numbers = ["weights", "grads", "optim", "activ", "logits", "peak"] + (["DS est", "CPU"] if wide else [])
    for col in numbers:
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("fits", no_wrap=True, min_width=4)
    for r in report.rows:
        mark = "" if report.budget_gib is None else ("yes" if r.fits else "no")
        if report.best is r:
            mark = "BEST"
        cells = [g(r.weights), g(r.grads), g(r.optimizer), g(r.activations), g(r.logits), g(r.peak)]
        if wide:
            cells += [g(r.ds_estimate) if r.ds_estimate is not None else "-", g(r.cpu)]
        table.add_row(r.name, *cells, mark)
    con.print(table)
    if not wide:
        con.print("(DeepSpeed's estimate and CPU memory: a wider terminal, or --json)")
    con.print("GiB per GPU. 'DS est.' is DeepSpeed's own model-states estimate (no activations). "
              "Offload trades GPU memory for steps several times slower: a last resort.")
    if report.best:
        con.print(f"recommended: {report.best.name} (peak {report.best.peak_gib:.2f} GiB)")
    elif report.budget_gib is not None:
        con.print(f"nothing fits: {report.why_none}")
