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

    from server.fastcore.quant import make_linear

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
                    mod(x)
                    t = triton.testing.do_bench(lambda: mod(x), warmup=50, rep=200)
                nbytes = sum(b.numel() * b.element_size() for b in list(mod.parameters()) + list(mod.buffers()))
                rows.append({"layer": name, "N": N, "K": K, "M": M, "kernel": kind, "us": t * 1e3,
                             "GBps": nbytes / (t / 1e3) / 1e9, "bw_pct": 100 * nbytes / (t / 1e3) / copy_bw,
                             "chosen": chosen_kernel(kind, M, N, K)})
                print(f"{name:8} M={M:<3} {kind:12} {t * 1e3:9.1f} us  {rows[-1]['GBps']:7.0f} GB/s "
                      f"({rows[-1]['bw_pct']:.0f} % of copy) {rows[-1]['chosen'] or ''}", flush=True)
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


def chosen_kernel(kind: str, M: int, N: int, K: int) -> str | None:
    """Which Triton kernel and config the launcher settled on for this shape (tiled or matrix-vector)."""
    if not kind.endswith("-triton"):
        return None
    from server.fastcore import triton_mm

    return triton_mm.chosen(kind.split("-")[0], M, N, K)


if __name__ == "__main__":
    raise SystemExit(main())
