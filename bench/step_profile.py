"""Where a decode step's time goes, kernel by kernel, and what a long prompt costs, per weight format.

    python -m quantserve.bench.step_profile --model 1b --quants none,int8 --prompt-len 512 --out prof.json

The fast engine on random weights of the Llama-3.2-1B / 3.1-8B shape under the T4 profile (fp16, a
T4's SDPA kernels; the 15 GiB memory cap is not applied: it changes no timing, and fp16 8B would not
fit it), as `bench decode` builds it.  For each format: the compiled, CUDA-graphed batch-1 step timed
over `--steps` steps (tokens fed back on the device, as `bench decode` does), then 16 steps under
torch.profiler with every GPU kernel grouped (weight matmuls, attention, inductor's fused element-wise
kernels, fills/casts, the rest).  The step's time without the profiler minus the kernels' sum is the
GPU idle between kernels (the profiled wall time carries the profiler's own overhead).
Then one prompt of `--prompt-len` tokens (eager, as `bench decode` runs prompts), best of 3 after one
untimed call (that one tunes the prompt-sized kernels), and the sum of its kernels' GPU time under
torch.profiler (the wall time of an eager forward carries the host's launches, which differ between
machines: 25 against 45 ms for the same fp16 prompt on two H100s of one day).
With `--graph-prompts`: each size's prompt as a server runs it, one compiled forward replayed from
the CUDA graph of its token bucket (size - 1 tokens, so the bucket is `size`), wall time best of 5.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

def group(name: str) -> str:
    """A kernel's group.  inductor names a fused kernel after every op in it, so a norm whose input is
    our int8 matmul's output is called `..._to_copy_add_int8_weight_mm_mean...`: its own matrix-vector
    reductions (fp16 weights) are the ones with `_mm_` and no `weight_mm`."""
    if re.search(r"_int[48]_(gemv_|rows_)?kernel", name):
        return "weights: ours int8/int4"
    if name.startswith("triton_") and "_mm_" in name and "weight_mm" not in name:
        return "weights: inductor's fused fp16 matrix-vector (norms folded in)"
    if re.search(r"_attention_kernel|_partial_kernel|_merge_kernel", name):
        return "attention (split-KV + merge)"
    if name.startswith("triton_"):
        return "inductor fused element-wise (norms, rope + KV write, silu * mul)"
    if re.search(r"gemv|gemm|sm90_|cutlass|GEMV|gemlite", name):
        return "weights: cuBLAS / GemLite"
    if "ArgMax" in name or "argmax" in name:
        return "argmax (the benchmark's token feedback)"
    if re.search(r"[Ff]ill|[Mm]emset", name):
        return "zero-fill (split-K)"
    if "copy" in name:
        return "copies / casts"
    return "other"


def profile_steps(step, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    rows = sorted(({"name": e.key[:120], "group": group(e.key), "calls": round(e.count / steps, 2),
                    "us": round(e.self_device_time_total / steps, 2)} for e in kernels), key=lambda r: -r["us"])
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"us": 0.0, "calls": 0.0})
        g["us"] = round(g["us"] + r["us"], 2)
        g["calls"] = round(g["calls"] + r["calls"], 2)
    total = sum(r["us"] for r in rows)
    return {"wall_us": round(wall * 1e6, 1), "kernel_us": round(total, 1), "kernels_per_step": round(sum(r["calls"] for r in rows), 1),
            "idle_us": round(wall * 1e6 - total, 1), "groups": groups, "kernels": rows}


def run_one(shape: str, quant: str, kernel: str, steps: int, prompt_len: int, caps, context: int = 128,
            graph_prompts: list[int] = ()) -> dict:
    import torch

    from quantserve.bench.decode import model_config
    from quantserve.server.fastcore import FastCore

    cfg = model_config(shape)
    t0 = time.perf_counter()
    core = FastCore(None, random_config=cfg, max_slots=1, max_seq=-(-(max(prompt_len, context, *graph_prompts) + steps + 64) // 256) * 256,
                    device=torch.device("cuda"), weight_quant=quant, quant_kernel=kernel, compile=True,
                    profile=caps.profile)
    core.steps.compile_mixed = False  # prompts eagerly: this measures decode
    row = {"model": shape, "quant": quant, "kernel": core.quant_kernel if quant != "none" else None,
           "weight_bytes": core.weight_bytes_per_token(), "build_s": round(time.perf_counter() - t0, 1)}
    prompt = torch.randint(0, cfg.vocab_size, (context,))
    first = int(core.prefill(0, prompt).argmax())
    core.pool.reserve(0, context + steps + 8)  # every position the timed steps write
    core.sync_table()
    inputs = torch.tensor([[first], [context], [0]], device="cuda")
    at = [context]  # the steps' position, on the host as the server knows it

    @torch.inference_mode()  # as the server steps
    def step(inputs):  # with the blocks the sequence spans after it, as the server passes them (graphs.py)
        at[0] += 1
        tok = core.steps.decode_raw(inputs, -(-at[0] // 16)).argmax(-1)
        return torch.stack([tok, inputs[1] + 1, inputs[2]])

    t1 = time.perf_counter()
    with torch.inference_mode():  # every decode graph of batch 1, as a server's warm-up records them
        core.steps.warm_decode(1)
    for _ in range(3):  # the first replays
        inputs = step(inputs)
    torch.cuda.synchronize()
    row["warmup_s"] = round(time.perf_counter() - t1, 1)
    t1 = time.perf_counter()
    for _ in range(steps):
        inputs = step(inputs)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t1) / steps
    row.update(step_ms=round(step_s * 1e3, 4), tok_s=round(1 / step_s, 1))
    fixed, kv_blocks = inputs.clone(), -(-(at[0] + 1) // 16)

    @torch.inference_mode()
    def one_step():  # at a fixed position: the profile does not move the KV length
        core.steps.decode_raw(fixed, kv_blocks).argmax(-1)

    row["profile"] = profile_steps(one_step, 16)
    print(f"{shape} {quant:5} {row['kernel'] or 'fp16':8} {row['tok_s']:8.1f} tok/s  step {row['step_ms']:.3f} ms  "
          f"kernels {row['profile']['kernel_us']:.0f} us in {row['profile']['kernels_per_step']:.0f} kernels, "
          f"idle {row['profile']['idle_us']:.0f} us  (warm-up {row['warmup_s']} s)", flush=True)
    for g, v in sorted(row["profile"]["groups"].items(), key=lambda kv: -kv[1]["us"]):
        print(f"    {v['us']:8.1f} us  {v['calls']:6.1f} kernels  {g}", flush=True)
    for r in row["profile"]["kernels"][:14]:
        print(f"        {r['us']:8.1f} us  x{r['calls']:<6} {r['name'][:90]}", flush=True)
    if prompt_len:
        ids = torch.randint(0, cfg.vocab_size, (prompt_len,))
        row["prompt_len"], row["prompt_ms"] = prompt_len, round(best_prefill_ms(core, ids, 3), 2)
        # the wall time carries the host's launches (an eager forward): the kernels' own time is the
        # prompt's cost on the GPU, what a server's compiled, batched prompt steps come close to
        from torch.profiler import ProfilerActivity, profile

        core.release(0)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            core.prefill(0, ids)
            torch.cuda.synchronize()
        row["prompt_gpu_ms"] = round(sum(e.self_device_time_total for e in prof.key_averages()
                                         if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3, 2)
        print(f"    prompt of {prompt_len} tokens: {row['prompt_ms']:.2f} ms (best of 3, eager), "
              f"{row['prompt_gpu_ms']:.2f} ms of GPU kernels", flush=True)
    if graph_prompts:
        row["graph_prompt_ms"] = graph_prompt_times(core, graph_prompts, cfg.vocab_size)
    return row


def best_prefill_ms(core, ids, runs: int) -> float:
    """The fastest of `runs` prefills of `ids` into an emptied slot 0, in ms, after one untimed call
    (it tunes the prompt-sized kernels, or records the step's CUDA graph)."""
    import torch

    times = []
    for _ in range(runs + 1):
        core.release(0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        core.prefill(0, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t1)
    return min(times[1:]) * 1e3


def graph_prompt_times(core, sizes: list[int], vocab: int) -> dict:
    """{size: ms}: a prompt of size - 1 tokens through the mixed CUDA graph of the `size` bucket (what
    a server replays), best of 5."""
    import torch

    times = {}
    core.steps.compile_mixed = True
    for size in sizes:
        times[str(size)] = round(best_prefill_ms(core, torch.randint(0, vocab, (size - 1,)), 5), 3)
        print(f"    prompt step of {size} tokens: {times[str(size)]:.3f} ms (CUDA graph, best of 5)", flush=True)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.step_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", help="1b or 8b")
    ap.add_argument("--quants", default="none,int8", help="comma list of none, int8, int4")
    ap.add_argument("--kernel", default="auto", help="int8/int4 kernels: auto, triton or gemlite")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--context", type=int, default=128, help="tokens in the KV cache before the timed steps")
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens of the timed prompt (0: none)")
    ap.add_argument("--graph-prompts", default="", help="comma list of token buckets whose prompt steps to "
                    "time from CUDA graphs (e.g. 256,512,2048)")
    ap.add_argument("--out", default="bench/results/step_profile.json", help="JSON file to write")
    ap.add_argument("--save-choices", default=None, metavar="PATH",
                    help="also write the weight kernels' choices tuned here (kernel_choices.py's JSON; "
                         "bench/kernel_table.py merges them into a GPU's shipped table)")
    args = ap.parse_args(argv)
    graph_prompts = [int(s) for s in args.graph_prompts.split(",") if s.strip()]
    from quantserve.server.fastcore.graphs import TOKEN_BUCKETS

    if any(s not in TOKEN_BUCKETS or s > 2048 for s in graph_prompts):
        print(f"error: --graph-prompts takes token buckets up to 2048 ({', '.join(map(str, TOKEN_BUCKETS[:13]))})",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: step_profile needs a CUDA GPU", file=sys.stderr)
        return 1
    from quantserve.capabilities import apply_profile, detect

    caps = detect("t4")
    apply_profile(caps)
    torch.cuda.set_per_process_memory_fraction(1.0, 0)  # the cap lifted (see above)
    torch.set_grad_enabled(False)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "profile": caps.profile,
              "context": args.context, "rows": []}
    for quant in [q for q in args.quants.split(",") if q]:
        try:
            result["rows"].append(run_one(args.model, quant, args.kernel, args.steps, args.prompt_len, caps,
                                          args.context, graph_prompts))
        except Exception as e:  # noqa: BLE001  (one format failing keeps the others)
            import traceback

            traceback.print_exc()
            result["rows"].append({"model": args.model, "quant": quant, "error": repr(e)[:300]})
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.save_choices:
        from quantserve.server.fastcore import kernel_choices

        kernel_choices.save_choices(args.save_choices)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
