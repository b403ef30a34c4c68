"""Weight-only matmul kernels alone, on the 8B shape's layers: time per call and the bandwidth it
reaches, fp16 (cuBLAS) against int8/int4 (our Triton kernels; torch ops), same run, same GPU.

    python -m bench.kernels --out bench/results/kernels.json

A decode step at batch 1 is these five matmuls per layer (x 32 layers) plus lm_head, so the sum
over one layer x 32 + lm_head is the weight-read time of a step: the ratio fp16 / int8 is the
speed-up the kernels allow before any other per-step overhead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (name, N out, K in) of Llama-3.1-8B: fused qkv, o, fused gate+up, down, lm_head
LAYERS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HEAD = ("lm_head", 128256, 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--out", default="bench/results/kernels.json")
    args = ap.parse_args(argv)

    import torch
    import triton.testing

    from quantserve.server.fastcore.quant import make_linear

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    src = torch.ones(2**29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 2 / (ms / 1e3)
    rows = []
    for name, N, K in LAYERS + [HEAD]:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        mods = {"fp16": make_linear(w, None, "none", torch.float16),
                "int8-triton": make_linear(w, None, "int8", torch.float16, "triton"),
                "int4-triton": make_linear(w, None, "int4", torch.float16, "triton"),
                "int8-torch": make_linear(w, None, "int8", torch.float16, "torch")}
        del w
        for M in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            for kind, mod in mods.items():
                with torch.inference_mode():
                    before = tuner_timings()
                    mod(x)
                    tuned = {k: v for k, v in tuner_timings().items() if v is not before.get(k)}
                    t = gpu_time(lambda: mod(x))
                nbytes = sum(b.numel() * b.element_size() for b in list(mod.parameters()) + list(mod.buffers()))
                row = {"layer": name, "N": N, "K": K, "M": M, "kernel": kind, "us": t * 1e3,
                       "GBps": nbytes / (t / 1e3) / 1e9, "bw_pct": 100 * nbytes / (t / 1e3) / copy_bw}
                if kind.endswith("-triton"):
                    row.update(triton_details(kind.split("-")[0], mod, x, tuned))
                rows.append(row)
                print(f"{name:8} M={M:<3} {kind:12} {t * 1e3:9.1f} us  {row['GBps']:7.0f} GB/s "
                      f"({row['bw_pct']:.0f} % of copy) {row.get('chosen', '')} "
                      f"{'plain .to() conversion: %.1f us' % row['plain_cvt_us'] if 'plain_cvt_us' in row else ''}",
                      flush=True)
        del mods
        torch.cuda.empty_cache()
    summary = {}
    for M in [int(b) for b in args.batches.split(",")]:
        step = {}
        for kind in ("fp16", "int8-triton", "int4-triton", "int8-torch"):
            per = {r["layer"]: r["us"] for r in rows if r["M"] == M and r["kernel"] == kind}
            step[kind] = 32 * sum(per[n] for n, _, _ in LAYERS) + per["lm_head"]
        summary[f"M={M}"] = {k: {"step_weight_ms": v / 1e3, "vs_fp16": step["fp16"] / v} for k, v in step.items()}
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9,
                                          "rows": rows, "summary": summary}, indent=1))
    return 0


def gpu_time(fn) -> float:
    """Milliseconds per call replayed from a CUDA graph, as the decode step runs it: timed eagerly,
    a small layer measures the Python and launch overhead of the call instead of the kernel."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100)


def tuner_timings() -> dict:
    """Each Triton autotuner's latest {config: [median, p20, p80] ms}: the object changes when it tunes."""
    from quantserve.server.fastcore import triton_gemv, triton_mm

    tuners = {"tiled int8": triton_mm.int8_kernel, "tiled int4": triton_mm.int4_kernel,
              "gemv int8": triton_gemv.int8_gemv_kernel, "gemv int4": triton_gemv.int4_gemv_kernel}
    return {name: getattr(t, "configs_timings", None) for name, t in tuners.items()}


def triton_details(weights: str, mod, x, tuned: dict) -> dict:
    """Which kernel and config the launcher kept, every config's time the autotuners measured for
    this shape, and the kept one re-timed with Triton's plain int -> float conversion instead of
    the bit-pattern one (triton_dequant.py): the same-run baseline for that choice."""
    from quantserve.server.fastcore import triton_mm

    M, K = x.shape
    N = mod.weight.shape[0]
    fn, config, block_m = triton_mm.chosen(weights, M, N, K)
    if weights == "int8":
        kernel_args, extra = (x, mod.weight, mod.scales), {}
    else:
        kernel_args, extra = (x, mod.weight, mod.scales, mod.mins), {"GROUP": mod.group_size}

    def plain():
        return triton_mm._run(fn, config, block_m, M, N, K, x, kernel_args, {**extra, "BIT_DEQUANT": False})

    plain()
    return {"chosen": f"{fn.__name__} {config.kwargs} warps={config.num_warps}",
            "plain_cvt_us": gpu_time(plain) * 1e3,
            "autotune_us": {name: {f"{c.kwargs} warps={c.num_warps}": round(v[0] * 1e3, 2) if isinstance(v, (list, tuple)) else v
                                   for c, v in timings.items()}
                            for name, timings in tuned.items() if timings}}


if __name__ == "__main__":
    raise SystemExit(main())
