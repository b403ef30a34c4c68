"""Decode speed of the fast core in-process, against plain `model.generate`, with roofline fractions.

    quantserve bench decode                       # 1B and 8B shapes, fp16/int8/int4, batch 1/8/32
    quantserve bench decode --gpu-profile t4      # the same under the T4 profile (15 GiB cap)
    quantserve bench decode --quick               # a tiny model on the CPU: exercises every path

Random weights in the Llama-3.2-1B / Llama-3.1-8B shapes are made directly on the device (no
checkpoint, no CPU RAM).  The roofline is the copy bandwidth measured in this run: a decode step
must read every weight once, so tok/s <= bandwidth / weight bytes per token at batch 1.  For a
batch the step also reads each sequence's KV prefix; `roofline %` is achieved bytes/s over
bandwidth for the whole step.

Under the T4 profile an fp16 8B model (16 GB) does not fit the 15 GiB cap: the plain-generate
baseline and the fp16 rows then run with the cap lifted and say so (`capped` = False); int8/int4
rows always run under the cap, and a fit check fills 8 slots x 2048 tokens of KV cache there.
Every row is independent: a failure is recorded in its `error` field and the run goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from quantserve.bench.decode_device import Cap, copy_bandwidth, free, sync
from quantserve.bench.decode_report import finish, print_table
from quantserve.settings import UserError

def _llama(h, f, n, heads, kv, vocab, theta) -> tuple[str, dict]:
    return "llama", dict(hidden_size=h, intermediate_size=f, num_hidden_layers=n, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, rope_theta=theta)


SHAPES = {  # name: (config.json model_type, the real model's layout); weights are random
    "1b": _llama(2048, 8192, 16, 32, 8, 128256, 500000.0),   # Llama-3.2-1B (untied here)
    "8b": _llama(4096, 14336, 32, 32, 8, 128256, 500000.0),  # Llama-3.1-8B
    "tiny": _llama(256, 768, 2, 4, 2, 1024, 10000.0),  # --quick
    # the 8B-class shapes of other families: q/k/v biases (Qwen2.5), q/k norms per head (Qwen3)
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 rope_theta=1000000.0)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               rope_theta=1000000.0)),
}
QUANTS = ("none", "int8", "int4")
KERNELS = ("auto", "triton", "gemlite", "torch", "tinygemm")
ATTENTIONS = ("auto", "triton", "sdpa")
# fastcore/fused.py: a one-token step's element-wise work inside the weight kernels: as the server
# runs it ("default": silu(gate) * up and the residual adds, and int8's norms), none ("off"), all of
# it ("on": int4's norms too), or the gate and residual by name
FUSIONS = ("default", "off", "on", "gate+residual")
_FUSED_DECODE = {"default": None, "off": "0", "on": "1", "gate+residual": "gate,residual"}  # $QUANTSERVE_FUSED_DECODE


@dataclass(frozen=True)
class DecodeOptions:
    """One run of `quantserve bench decode`: its options (the command's defaults are these), kept
    in the result JSON as `settings`."""
    models: tuple[str, ...] = ("1b", "8b")  # of SHAPES
    quants: tuple[str, ...] = QUANTS
    kernels: tuple[str, ...] = ("auto",)  # int8/int4 kernels, of KERNELS
    attention: tuple[str, ...] = ("auto",)  # of ATTENTIONS; the first is the one other rows compare to
    # of FUSIONS: "default" is what the server runs; "off" rows are named "...-unfused", "on" rows
    # "...-fused", "gate+residual" rows "...-fused-gate+residual" (from 2026-12-05 to 2026-12-06 "off"
    # was the default and had no suffix; before, "on")
    fusion: tuple[str, ...] = ("default",)
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 128
    new_tokens: int = 128
    generate_tokens: int = 16  # at least 2: the rate is t(N) - t(1) over N - 1 tokens
    generate_batches: tuple[int, ...] = (1,)  # () = no plain-generate baseline
    gpu_profile: str | None = None
    no_compile: bool = False
    no_fit_check: bool = False
    profile_steps: int = 0
    quick: bool = False
    out: str = "bench/results/decode.json"


def model_config(shape: str):
    from transformers import AutoConfig

    model_type, layout = SHAPES[shape]
    return AutoConfig.for_model(model_type, **layout, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                tie_word_embeddings=False)


def bench_generate(cfg, device, dtype, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Plain transformers generate, decode-only rate: (t(N tokens) - t(1 token)) / (N - 1)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n):
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(device)
        return time.perf_counter() - t0

    timed(2)  # warm-up
    # the best of five of each, interleaved: one stall in a single t(1) made the difference negative
    # (seen on CI), and a burst of load on the machine once made all three t(1) in a row slower
    # than t(N) (seen with other tests running beside it)
    t1s, tns = [], []
    for _ in range(5):
        t1s.append(timed(1))
        tns.append(timed(new_tokens))
    t1, tn = min(t1s), min(tns)
    step = (tn - t1) / (new_tokens - 1)
    if step <= 0:
        raise RuntimeError(f"timing too noisy: {new_tokens} tokens took {tn:.4f} s, 1 token {t1:.4f} s")
    wbytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n)
    del model
    return {"step_ms": step * 1e3, "tok_s": batch / step, "weight_bytes": wbytes}


def step_profile(step, device, steps: int = 16, top: int = 12) -> dict:
    """Where a decode step's time goes: device time per step of each kernel (top `top`), their sum,
    and the step's wall time; wall minus kernel time is the device sitting idle between kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = (time.perf_counter() - t0) / steps
    events = [e for e in prof.key_averages()
              if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda and e.self_device_time_total + e.self_cpu_time_total > 0]
    us = lambda e: (e.self_device_time_total if cuda else e.self_cpu_time_total) / steps  # noqa: E731
    events.sort(key=us, reverse=True)
    return {"wall_us": round(wall * 1e6, 1), "kernel_us": round(sum(us(e) for e in events), 1),
            "top": [{"name": e.key[:90], "calls": round(e.count / steps, 1), "us": round(us(e), 1)}
                    for e in events[:top]]}


def bench_core(cfg, device, caps, quant: str, kernel: str, batches: list[int], prompt_len: int,
               new_tokens: int, compile: bool, profile_steps: int = 0, attention: str = "auto",
               fusion: str = "default"):
    """FastCore decode at each batch size: prefill `prompt_len` tokens per slot, then time
    `new_tokens` steps feeding the argmax back on the device (no host sync inside the loop).
    fusion (of FUSIONS): which of batch 1's norms, gate and residual adds run inside its weight kernels (fused.py).
    Yields one row per batch size as it is measured, so a run cut short keeps the rows it finished."""
    import torch

    from quantserve.server.fastcore import FastCore

    t0 = time.perf_counter()
    max_seq = -(-(prompt_len + new_tokens + 8) // 256) * 256
    # the fused batch-1 forms (fused.fused_decode_forms, read as the layers are built) are asked
    # for this build only, so the caller's environment is left as it was
    before = os.environ.pop("QUANTSERVE_FUSED_DECODE", None)
    if _FUSED_DECODE[fusion] is not None:
        os.environ["QUANTSERVE_FUSED_DECODE"] = _FUSED_DECODE[fusion]
    try:
        core = FastCore(None, random_config=cfg, max_slots=max(batches), max_seq=max_seq, device=device,
                        weight_quant=quant, quant_kernel=kernel, compile=compile, profile=caps.profile,
                        attention=attention)
    finally:
        os.environ.pop("QUANTSERVE_FUSED_DECODE", None)
        if before is not None:
            os.environ["QUANTSERVE_FUSED_DECODE"] = before
    build_s = time.perf_counter() - t0
    # Prompts eagerly: this measures decode, and the compiled prompt path (torch.compile with
    # dynamic shapes over the whole model) is a minute or more of compile on the 8B shape before
    # the first step, which ran two GPU calls' rows out of their time (bench/RESULTS.md).
    core.steps.compile_mixed = False
    print(f"  {quant}: weights ready in {build_s:.1f} s", file=sys.stderr, flush=True)
    wbytes = core.weight_bytes_per_token()
    kv_tok = core.kv_bytes_per_token()
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,))
    resident_gib = round(core.resident_bytes() / 2**30, 2)
    for b in batches:
        row = {"batch": b, "weight_bytes": wbytes, "build_s": round(build_s, 1), "attention": core.attention,
               "kernel": core.quant_kernel if quant != "none" else None, "resident_gib": resident_gib}
        try:
            t1 = time.perf_counter()
            first = [int(core.prefill(s, prompt).argmax()) for s in range(b)]
            row["first_prompts_s"] = round(time.perf_counter() - t1, 1)  # the prompt path's compile, first time
            for s in range(b):  # every position the timed steps write, reserved now
                core.pool.reserve(s, prompt_len + new_tokens + 1)
            core.sync_table()
            slots = torch.arange(b, device=device)
            inputs = torch.stack([torch.tensor(first, device=device), torch.full((b,), prompt_len, device=device), slots])
            at = [prompt_len]  # the steps' position, on the host as the server knows it

            @torch.inference_mode()  # as the server steps (a graph recorded by a 1-token prompt holds inference tensors)
            def step(inputs):  # one token per sequence, the argmax fed back on the device
                # the blocks the sequences span after the step, as the server passes them: the
                # decode graph is picked by them (a short context's or a longer one's, graphs.py)
                at[0] += 1
                tok = core.steps.decode_raw(inputs, -(-at[0] // 16)).argmax(-1)
                return torch.stack([tok, inputs[1] + 1, inputs[2]])

            t1 = time.perf_counter()
            with torch.inference_mode():  # every decode graph of b rows (the steps' width), as a server's warm-up
                core.steps.warm_decode(b)
            for _ in range(3):  # the first replays
                inputs = step(inputs)
            sync(device)
            row["warmup_s"] = round(time.perf_counter() - t1, 1)
            # as it happens: a run cut short by a time limit still says where its minutes went
            print(f"  batch {b}: built in {build_s:.1f} s, first prompts {row['first_prompts_s']} s, "
                  f"decode compile + record {row['warmup_s']} s", file=sys.stderr, flush=True)
            n = new_tokens - 3
            t1 = time.perf_counter()
            for _ in range(n):
                inputs = step(inputs)
            sync(device)
            step = (time.perf_counter() - t1) / n
            avg_ctx = prompt_len + 3 + n / 2
            step_bytes = wbytes + b * avg_ctx * kv_tok  # weights once + each sequence's KV prefix
            row.update(step_ms=step * 1e3, tok_s=b / step, step_bytes=step_bytes)
            if device.type == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if b == 1 and quant in ("int8", "int4") and device.type == "cuda":
                row["batch1_forms"] = batch1_forms(quant)
                print(f"  batch 1 kernels kept: {row['batch1_forms']}", file=sys.stderr, flush=True)
            if profile_steps and b == batches[0]:
                fixed, kv_blocks = inputs.clone(), -(-(at[0] + 1) // 16)

                @torch.inference_mode()
                def one_step():  # the same step at a fixed position: the profile does not move the KV length
                    core.steps.decode_raw(fixed, kv_blocks).argmax(-1)

                row["profile"] = step_profile(one_step, device, profile_steps)
        except Exception as e:  # one failing row must not lose the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            traceback.print_exc(file=sys.stderr)
        for s in range(max(batches)):
            core.release(s)
        yield row
    del core


def batch1_forms(quant: str) -> dict:
    """Layer shapes per kernel and form the launcher kept at batch 1 for `quant` weights (the tiled
    kernel, or the matrix-vector one with its float, packed fp16 or dp4a products)."""
    from quantserve.server.fastcore import triton_mm

    forms: dict[str, int] = {}
    for (name, _, batch1, *_), (fn, _, _, flags) in list(triton_mm._chosen.items()):
        if name == f"_{quant}_kernel" and batch1:
            on = [k for k, v in sorted(flags.items()) if v is True]
            form = triton_mm._kernel_name(fn) + (f" {'+'.join(on)}" if on else "")
            forms[form] = forms.get(form, 0) + 1
    return forms


def fit_check(cfg, device, caps, quant: str, kernel: str, slots: int = 8, seq: int = 2048) -> dict:
    """Under the cap: weights + a KV cache of `slots` x `seq`, every slot filled to ~seq, one step."""
    import torch

    from quantserve.server.fastcore import FastCore

    core = FastCore(None, random_config=cfg, max_slots=slots, max_seq=seq, device=device,
                    weight_quant=quant, quant_kernel=kernel, compile=False, profile=caps.profile)
    fill = seq - 16
    for s in range(slots):
        core.prefill(s, torch.randint(0, cfg.vocab_size, (fill,)))
    core.decode(list(range(slots)), [1] * slots)
    sync(device)
    out = {"slots": slots, "seq": seq, "ok": True,
           "resident_gib": round(core.resident_bytes() / 2**30, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}
    del core
    return out


def run(o: DecodeOptions) -> None:
    """Measure every (model, quant, kernel, attention, batch) row of `o`, writing `o.out` after each
    row; raises UserError where this machine cannot run it."""
    import torch

    with torch.no_grad():  # here, not process-wide: a caller in the same process keeps its grad mode
        _measure(o)


def _measure(o: DecodeOptions) -> None:
    import torch

    from quantserve.bench.args import require_writable_output
    from quantserve.capabilities import apply_profile, detect

    require_writable_output(o.out)

    if o.quick:  # its sizes where none were given (a given --new-tokens or --batches is kept)
        quick = dict(models=("tiny",), batches=(1, 4), prompt_len=16, new_tokens=12,
                     generate_tokens=32, no_fit_check=True)  # enough steps to stand above timing noise
        o = replace(o, **{k: v for k, v in quick.items() if getattr(o, k) == getattr(DecodeOptions, k)})
    caps = detect(o.gpu_profile)
    if caps.device != "cuda" and set(o.models) - {"tiny"}:
        # the 1B/8B shapes at fp32 on a CPU would grind for hours and measure nothing useful
        raise UserError("bench decode measures the 1B/8B shapes on a CUDA GPU; on a CPU use --quick "
                        "(without --models)")
    apply_profile(caps)
    device = torch.device(caps.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    compile = device.type == "cuda" and not o.no_compile
    batches = list(o.batches)
    cap = Cap(caps)
    cap.set(False)
    bw = copy_bandwidth(device, gib=1.0 if device.type == "cuda" else 0.125)
    print(f"device {caps.gpu_name or 'cpu'}  profile {caps.profile}  copy bandwidth {bw / 1e9:.0f} GB/s  "
          f"compile {compile}", flush=True)
    result = {"device": caps.as_dict(), "bandwidth_Bps": bw, "settings": asdict(o), "rows": [], "fit": []}

    def add(row):
        result["rows"].append(row)
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(json.dumps(result, indent=1))  # partial results survive a crash
        msg = row.get("error") or f"{row['tok_s']:.1f} tok/s"
        print(f"  {row['model']:>4} {row['engine']:<22} b={row['batch']:<3} {msg}", flush=True)

    for shape in o.models:
        cfg = model_config(shape)
        fp16_bytes = _fp16_weight_bytes(cfg)
        fp16_fits = not cap.active or fp16_bytes / 2**30 < caps.memory_budget_gib - 1
        for b in o.generate_batches:
            row = {"model": shape, "engine": "generate", "quant": "none", "batch": b, "capped": cap.active and fp16_fits}
            try:
                cap.set(fp16_fits)
                row.update(bench_generate(cfg, device, dtype, b, o.prompt_len, o.generate_tokens))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            free(device)
            add(row)
        for quant in o.quants:
            kernels = [k for k in o.kernels if quant == "int4" or k != "tinygemm"] if quant != "none" else ["-"]
            for kernel, attention, fusion in [(k, a, f) for k in kernels for a in o.attention for f in o.fusion]:
                capped = quant != "none" or fp16_fits
                engine = "fastcore-" + {"none": "fp16" if dtype == torch.float16 else "fp32"}.get(quant, quant)
                if quant != "none" and kernel != "auto":
                    engine += f"-{kernel}"
                if attention != "auto":
                    engine += f"-{attention}"
                if fusion != "default":
                    if quant == "none":
                        continue  # fp16 layers have nothing fused: one row is enough
                    engine += {"off": "-unfused", "on": "-fused"}.get(fusion, f"-fused-{fusion}")
                done = set()
                try:
                    cap.set(capped)
                    for r in bench_core(cfg, device, caps, quant, kernel if kernel != "-" else "auto", batches,
                                        o.prompt_len, o.new_tokens, compile, o.profile_steps, attention,
                                        fusion):
                        add({"model": shape, "engine": engine, "quant": quant, "capped": cap.active and capped, **r})
                        done.add(r["batch"])
                except Exception as e:  # the engine failed to build: every batch size not measured says why
                    traceback.print_exc(file=sys.stderr)
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    for b in batches:
                        if b not in done:
                            add({"model": shape, "engine": engine, "quant": quant, "capped": cap.active and capped,
                                 "batch": b, "error": err})
                free(device)
                if not o.no_fit_check and device.type == "cuda" and quant != "none" and shape == "8b":
                    try:
                        cap.set(True)
                        fit = fit_check(cfg, device, caps, quant, kernel if kernel != "-" else "auto")
                    except Exception as e:
                        fit = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                    free(device)
                    fit.update(model=shape, engine=engine, capped=cap.active)
                    result["fit"].append(fit)
                    print(f"  fit check {shape} {engine}: {fit}", flush=True)
    finish(result)
    Path(o.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {o.out}")


def main(argv: list[str] | None = None) -> int:
    """`python -m quantserve.bench.decode ARGS` (bench/decode_gpu.sh runs it so) is
    `quantserve bench decode ARGS`; returns the exit code."""
    from quantserve.bench.cli import script_main

    return script_main("decode", argv)


def _fp16_weight_bytes(cfg) -> int:
    h, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    per_layer = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * h * f
    return 2 * (n * per_layer + 2 * cfg.vocab_size * h)


if __name__ == "__main__":
    sys.exit(main())
