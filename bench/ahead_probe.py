"""Does dequantizing ahead on a second stream overlap the matmuls, and does cuBLAS need SMs left to it?

    python -m quantserve.bench.ahead_probe --blocks 8 --rows 512 --carveouts 0,16,32,48

A chain of the 8B shape's four int8 layers (qkv, o, gate-up, down) over `--blocks` blocks, each
layer taking the one before's output (cut to its width), replayed from a CUDA graph and timed with
events (best of 10): fp16 weights (cuBLAS alone), the in-line copy (dequantize, then cuBLAS), and
the copies made ahead on a second stream (server/fastcore/dequant_ahead.py) with cuBLAS told to
leave `carveout` SMs free (torch's experimental SM carveout), so that the copies find room beside
the matmuls.  The fp16 chain under each carveout shows whether cuBLAS takes the hint at all.
No attention or norms between the layers: it prices the overlap of the weights alone.
"""

from __future__ import annotations

import argparse
import json
import sys

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate-up, down: (N, K)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.ahead_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rows", default="512", help="comma list of token counts")
    ap.add_argument("--carveouts", default="0,16,32,48", help="comma list of SMs cuBLAS leaves free")
    ap.add_argument("--blas", default="cublas", help="torch's BLAS for fp16 matmuls: cublas or cublaslt "
                    "(torch applies the SM carveout to cuBLASLt's matmuls)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: ahead_probe needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.backends.cuda.preferred_blas_library(args.blas)
    from quantserve.server.fastcore import triton_mm
    from quantserve.server.fastcore.dequant_ahead import DequantAhead
    from quantserve.server.fastcore.quant import make_linear

    torch.manual_seed(0)
    layers = []
    for _ in range(args.blocks):
        for n, k in SHAPES:
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            layers.append((make_linear(w, None, "int8", torch.float16, "triton"), w))
    ring = DequantAhead([("int8", (q.weight, q.scales), None) for q, _ in layers], torch.device("cuda"),
                        torch.float16, min_rows=1)

    def chain(x, mm):
        y = x
        for q, w in layers:
            y = mm(y[:, :w.shape[1]].contiguous(), q, w)
        return y

    kinds = {
        "fp16": lambda x, q, w: torch.mm(x, w.t()),
        "inline": lambda x, q, w: triton_mm._int8_dense(x, q.weight, q.scales),
        "ahead": lambda x, q, w: triton_mm.int8_weight_mm(x, q.weight, q.scales),
    }

    def timed(kind: str, x) -> float:
        def run():
            if kind == "ahead":
                with ring.forward(x.shape[0]):
                    return chain(x, kinds[kind])
            return chain(x, kinds[kind])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        times = []
        for _ in range(11):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del graph
        return min(times[1:])

    result = {"gpu": torch.cuda.get_device_name(), "blas": args.blas, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
              "blocks": args.blocks, "rows": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.float16)
        for carveout in [int(c) for c in args.carveouts.split(",")]:
            torch._C._set_sm_carveout_experimental(carveout or None)
            row = {"tokens": rows, "carveout": carveout, **{k: round(timed(k, x), 3) for k in kinds}}
            torch._C._set_sm_carveout_experimental(None)
            row["inline/fp16"] = round(row["inline"] / row["fp16"], 3)
            row["ahead/fp16"] = round(row["ahead"] / row["fp16"], 3)
            result["rows"].append(row)
            print(f"M={rows} carveout {carveout:3}: fp16 {row['fp16']:.3f} ms, inline {row['inline']:.3f} "
                  f"({row['inline/fp16']}x), ahead {row['ahead']:.3f} ({row['ahead/fp16']}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
