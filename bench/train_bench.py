"""Training benchmark: tokens/s and peak memory per setup, next to `training.plan`'s prediction.

Rows (random weights, random tokens; each row in its own try/except so one failure loses nothing):
1. Llama-3.2-1B shape, full fine-tune (fp32 master weights, fp16 autocast + loss scaling, fused
   AdamW, the `quantserve train` recipe) at --seq-len: plain HF, +checkpointing, +Liger, +both.
   Attention is restricted to the T4's SDPA kernels (memory-efficient / math).
2. ZeRO-2 through DeepSpeed (one process), with and without optimizer offload: step-time ratio.
3. Llama-3.1-8B shape, QLoRA (NF4 + double quantization, LoRA r=16 on all linears, checkpointing)
   under the T4 profile (15 GiB cap): the longest context that fits.

    python bench/train_bench.py                # GPU, all rows (~6 min on an H200)
    python bench/train_bench.py --quick        # CPU smoke test on a tiny shape (< 1 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantserve.bench.args import quick_sizes
from quantserve.bench.train_report import Result, plot, print_table, summarize

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False)


def llama(shape: dict, layers: int | None, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**shape, **({"num_hidden_layers": layers} if layers else {})})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.config.use_cache = False
    return model


def reset_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def timed_steps(step, steps: int, warmup: int, device: str) -> float:
    """Mean seconds per step after `warmup` steps."""
    import torch

    for _ in range(warmup):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def hf_step_fn(model, params, batch, seq, vocab, device, amp: bool):
    """One optimizer step of the `quantserve train` recipe: autocast fp16 + GradScaler + fused AdamW."""
    import torch

    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    ids = torch.randint(0, vocab, (batch, seq), device=device)

    def step():
        with torch.autocast(device, dtype=torch.float16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def sdpa_t4():
    """The T4's SDPA kernels only (no flash / cuDNN), as the T4 profile enforces; and, as the
    profile does, transformers told to expand grouped K/V heads so those kernels accept them."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from quantserve.capabilities import expand_gqa_for_sdpa

    expand_gqa_for_sdpa()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def gqa_probe(device: str) -> str:
    """Does the memory-efficient SDPA kernel accept `enable_gqa` (8 K/V heads for 32 query heads)?"""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        return "not checked (CPU)"
    q = torch.randn(1, 32, 128, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.float16)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return "accepted"
    except RuntimeError as e:
        return "refused: " + str(e).splitlines()[0][:120]


def row_hf(args, caps, name: str, ckpt: bool, liger: bool) -> Result:
    import torch

    from quantserve.training.loading import apply_liger, enable_checkpointing
    from quantserve.training.plan import SHAPES, Shape, setup_row
    from transformers import LlamaConfig

    res = Result(name)
    if liger and not caps.liger:
        res.status, res.note = "skipped", "Liger needs liger-kernel and a CUDA GPU with Triton"
        return res
    dev, amp = caps.device, caps.device == "cuda"
    shape = TINY if args.quick else SHAPES["llama-3.2-1b"]
    reset_memory(dev)
    model = llama(shape, args.layers, dev, torch.float32)
    if liger:
        apply_liger(model, zero=None)
    if ckpt:
        enable_checkpointing(model)
    model.train()
    step = hf_step_fn(model, list(model.parameters()), args.batch, args.seq_len, shape["vocab_size"], dev, amp)
    with sdpa_t4():
        res.step_s = timed_steps(step, args.steps, args.warmup, dev)
    res.tokens_per_s = args.batch * args.seq_len / res.step_s
    res.peak_gib = peak_gib(dev)
    if dev == "cuda":  # between steps: weights + Adam state (gradients were set to None)
        res.extra["resident_gib"] = torch.cuda.memory_allocated() / 2**30
    s = Shape.from_config(LlamaConfig(**{**shape, "num_hidden_layers": args.layers or shape["num_hidden_layers"]}))
    res.plan_gib = setup_row(s, "full", None, "none", ckpt, liger, args.batch * args.seq_len, args.seq_len, 1,
                             dtype_bytes=2 if amp else 4).peak / 2**30
    del model, step
    return res


def row_zero2(args, caps, offload: str) -> Result:
    import deepspeed
    import torch
    from transformers import LlamaConfig

    from quantserve.training import distributed
    from quantserve.training.ds_config import build
    from quantserve.training.loading import apply_liger, enable_checkpointing
    from quantserve.training.plan import SHAPES, Shape, setup_row

    name = "ZeRO-2" + (" + optimizer offload" if offload != "none" else "")
    res = Result(name)
    dev = caps.device
    shape = TINY if args.quick else SHAPES["llama-3.2-1b"]
    seq = args.zero_seq_len
    distributed.single_process_env()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if dev == "cuda" else "gloo")
    reset_memory(dev)
    dtype = "float16" if dev == "cuda" else "float32"
    cfg = build(2, offload, dtype, t4=dev == "cuda")
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=1.0)
    if "optimizer" in cfg:
        cfg["optimizer"]["params"] = {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    model = llama(shape, args.layers, dev, torch.float32)
    enable_checkpointing(model)
    if caps.liger:
        apply_liger(model, zero=2)
    opt = None if "optimizer" in cfg else torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=model.parameters(), config=cfg)
    ids = torch.randint(0, shape["vocab_size"], (1, seq), device=engine.device)

    def step():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    with sdpa_t4():
        res.step_s = timed_steps(step, args.steps, args.warmup, dev)
    res.tokens_per_s = seq / res.step_s
    res.peak_gib = peak_gib(dev)
    s = Shape.from_config(LlamaConfig(**{**shape, "num_hidden_layers": args.layers or shape["num_hidden_layers"]}))
    res.plan_gib = setup_row(s, "full", 2, offload, True, caps.liger, seq, seq, 1,
                             dtype_bytes=2 if dev == "cuda" else 4).peak / 2**30
    res.note = f"batch 1 x {seq}, checkpointing{', Liger' if caps.liger else ''}"
    engine.destroy()
    del engine, model, opt
    return res


def quantize_linears(model, device: str) -> None:
    """NF4 + double quantization of every linear inside the decoder layers (what QLoRA loads)."""
    import bitsandbytes as bnb
    import torch

    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for cname, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.float16 if device == "cuda" else torch.float32,
                                          compress_statistics=True, quant_type="nf4", device="meta")
                    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                                 quant_type="nf4", module=q).to(device)
                    setattr(parent, cname, q)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def rows_qlora(args, caps) -> list[Result]:
    import torch
    from transformers import LlamaConfig

    from quantserve.capabilities import apply_profile, detect
    from quantserve.training.config import TrainConfig
    from quantserve.training.loading import apply_liger, enable_checkpointing, wrap_lora
    from quantserve.training.plan import SHAPES, Shape, setup_row

    dev = caps.device
    shape = TINY if args.quick else SHAPES["llama-3.1-8b"]
    reset_memory(dev)
    # Built in 16 bit before the T4 cap (the fp16 copy is larger than a T4), then quantized.
    model = llama(shape, None, dev, torch.float16 if dev == "cuda" else torch.float32)
    quantize_linears(model, dev)
    for p in model.parameters():
        p.requires_grad_(False)
    if caps.liger:
        apply_liger(model, zero=None)
    enable_checkpointing(model)
    model.enable_input_require_grads()
    model = wrap_lora(model, TrainConfig(data=Path("-"), out=Path("-"), method="qlora", grad_ckpt=True))
    model.train()
    t4 = detect("t4")
    apply_profile(t4)  # 15 GiB cap + T4 attention kernels from here on
    s = Shape.from_config(LlamaConfig(**shape))
    out = []
    for ctx in args.qlora_contexts:
        res = Result(f"8B QLoRA T4 @ {ctx}" if not args.quick else f"tiny QLoRA @ {ctx}")
        reset_memory(dev)
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            step = hf_step_fn(model, params, 1, ctx, shape["vocab_size"], dev, dev == "cuda")
            with sdpa_t4():
                res.step_s = timed_steps(step, max(1, args.steps // 2), 1, dev)
            res.tokens_per_s = ctx / res.step_s
            res.peak_gib = peak_gib(dev)
            res.note = "fits in 15 GiB" if dev == "cuda" else "CPU: no T4 cap"
        except torch.OutOfMemoryError:
            res.status, res.note = "oom", "does not fit in the T4's 15 GiB"
        res.plan_gib = setup_row(s, "qlora", None, "none", True, caps.liger, ctx, ctx, 1,
                                 dtype_bytes=2 if dev == "cuda" else 4).peak / 2**30
        out.append(res)
        step = None
        if res.status == "oom":
            break
    fitting = [int(r.row.rsplit("@ ", 1)[1]) for r in out if r.status == "ok"]
    if out:
        out[-1].extra["longest_fitting_context"] = max(fitting) if fitting else None
    del model
    return out


def run_row(results: list[Result], name: str, fn) -> None:
    print(f"running: {name}", file=sys.stderr, flush=True)
    try:
        got = fn()
        results.extend(got if isinstance(got, list) else [got])
    except Exception as e:  # one failure must not lose the other rows
        traceback.print_exc()
        results.append(Result(name, status="failed", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape on the CPU: a smoke test")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the 1B shape (default: all 16)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--zero-seq-len", type=int, default=2048)
    ap.add_argument("--qlora-contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf", "zero", "qlora"])
    ap.add_argument("--json", type=Path, default=Path("train_bench.json"))
    args = ap.parse_args()
    if args.quick:
        quick_sizes(args, ap, seq_len=128, batch=2, steps=2, warmup=1, zero_seq_len=128, qlora_contexts=[64, 128])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from quantserve.capabilities import detect

    caps = detect("native")
    if caps.device == "cpu":
        torch.set_num_threads(1)  # OpenMP spin-waiting on shared cores costs far more than it gives
    if caps.device == "cpu" and not args.quick:
        sys.exit("error: the full benchmark needs a CUDA GPU; use --quick on a CPU")
    print(f"device {caps.gpu_name or 'CPU'}, torch {caps.torch_version}, Liger "
          f"{'on' if caps.liger else 'off (' + ('not installed' if not caps.packages.get('liger_kernel') else 'no GPU/Triton') + ')'}",
          file=sys.stderr)
    results: list[Result] = []
    probe = gqa_probe(caps.device)
    print(f"memory-efficient SDPA with enable_gqa: {probe}", file=sys.stderr)
    if "hf" not in args.skip:
        for name, ckpt, liger in (("1B plain HF", False, False), ("1B + checkpointing", True, False),
                                  ("1B + Liger", False, True), ("1B + Liger + checkpointing", True, True)):
            run_row(results, name, lambda c=ckpt, lg=liger, n=name: row_hf(args, caps, n, c, lg))
    if "zero" not in args.skip:
        run_row(results, "ZeRO-2", lambda: row_zero2(args, caps, "none"))
        run_row(results, "ZeRO-2 + optimizer offload", lambda: row_zero2(args, caps, "optimizer"))
    if "qlora" not in args.skip:
        run_row(results, "8B QLoRA under the T4 profile", lambda: rows_qlora(args, caps))

    base = next((r for r in results if r.row == "1B plain HF" and r.status == "ok"), None)
    print_table(results, base)
    summary = summarize(results, base)
    summary["efficient_sdpa_enable_gqa"] = probe
    print("\nsummary: " + json.dumps(summary))
    args.json.write_text(json.dumps({"device": caps.as_dict(), "args": {k: str(v) for k, v in vars(args).items()},
                                     "rows": [{**r.__dict__, "plan_error": r.plan_error} for r in results],
                                     "summary": summary}, indent=1))
    print(f"wrote {args.json} and {plot([r.__dict__ for r in results], args.json.with_suffix('.png'))}", file=sys.stderr)


if __name__ == "__main__":
    main()
