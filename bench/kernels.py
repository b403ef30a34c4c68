"""Weight-only matmul kernels alone, per layer of the 8B and 1B shapes: fp16 against int8 and 4-bit.

µs per call and the share of copy bandwidth it reaches, fp16 (cuBLAS) against every int8 / 4-bit
path we can run.

    quantserve bench kernels --shapes 8b,1b --batches 1,8,32,512 --out bench/results/kernels.json
    quantserve bench kernels --sass sm_75      # also: every Triton kernel it ran, compiled for a T4

Cold (empty Triton caches) each layer took ~80 s with every kind and four batch sizes on an H200,
most of it the autotuners' first calls: one shape per 10-minute GPU call.

Kinds (a name is `weights-library`):
  fp16            torch.nn.functional.linear (cuBLAS)
  int8-triton     ours: server/fastcore/triton_mm.py + triton_gemv.py (per-shape choice at first call)
  int8-gemlite    GemLite's A16W8 on the same int8 weights and scales
  int4-triton     ours, group 128, w = q * scale + min
  int4-gemlite    GemLite's A16W4 on the same integers, scales and mins
  nf4-bnb         bitsandbytes' 4-bit layer (its own NF4 format, blocks of 64): its batch-1
                  inference kernel, dequantize + cuBLAS above
A decode step at batch M is these five matmuls per layer (x layers) plus lm_head, so the summary's
"step weight ms" is the weight-read time of a step: the ratio to fp16 is the speed-up the kernels
allow before any other per-step cost.  Times are replayed from a CUDA graph, as the decode step
runs them (timed eagerly, a small layer measures Python and launch overhead, not the kernel).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from quantserve.bench.decode_device import copy_bandwidth
from quantserve.settings import UserError

# (name, N out, K in): fused qkv, o, fused gate+up, down; layers; lm_head
SHAPES = {
    "8b": ([("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)], 32,
           ("lm_head", 128256, 4096)),
    "1b": ([("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)], 16,
           ("lm_head", 128256, 2048)),
}
KINDS = ("fp16", "int8-triton", "int8-gemlite", "int4-triton", "int4-gemlite", "nf4-bnb")


def build(kind: str, w):
    """The layer for `kind` from an fp16 weight [N, K] on the GPU, as a callable x -> y."""
    import torch

    from quantserve.server.fastcore.quant import make_linear

    if kind == "fp16":
        return make_linear(w, None, "none", torch.float16)
    if kind == "nf4-bnb":
        import bitsandbytes as bnb

        qw, state = bnb.functional.quantize_4bit(w, quant_type="nf4", blocksize=64)
        layer = lambda x: bnb.matmul_4bit(x, qw.t(), quant_state=state)  # noqa: E731  (Linear4bit's call)
        layer.nbytes = qw.numel() * qw.element_size() + state.absmax.numel() * state.absmax.element_size()
        return layer
    weights, library = kind.split("-")
    return make_linear(w, None, weights, torch.float16, library)


def weight_bytes(layer) -> int:
    from quantserve.server.fastcore.quant import linear_weight_bytes

    return layer.nbytes if hasattr(layer, "nbytes") else linear_weight_bytes(layer)


def gpu_time(fn) -> tuple[float, str]:
    """(milliseconds per call, how timed): replayed from a CUDA graph where the call can be
    captured, else eagerly (and said so)."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100), "graph"
    except Exception:  # noqa: BLE001  (a library call that cannot be captured)
        import torch

        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=100), "eager"


def available(kinds: list[str]) -> tuple[list[str], dict]:
    """The kinds whose library imports here, and why each other one is left out."""
    from quantserve.server.fastcore.quant import gemlite_available

    keep, skipped = [], {}
    for kind in kinds:
        if kind.endswith("-gemlite") and not gemlite_available():
            skipped[kind] = "gemlite does not import"
            continue
        if kind == "nf4-bnb":
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as e:
                skipped[kind] = f"bitsandbytes does not import: {e}"
                continue
        keep.append(kind)
    return keep, skipped


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))


def run_shape(shape: str, kinds: list[str], batches: list[int], copy_bw: float, rows: list, save) -> None:
    """Append a row per (layer, kind, M) to `rows`, calling save() after each layer: a run cut
    short by a time limit keeps what it measured."""
    import torch

    layers, _, head = SHAPES[shape]
    for name, N, K in layers + [head]:
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        ref = {M: None for M in batches}
        for kind in kinds:
            try:
                layer = build(kind, w)
            except Exception as e:  # noqa: BLE001  (a library refusing a shape: recorded, the run goes on)
                rows.append({"shape": shape, "layer": name, "N": N, "K": K, "kernel": kind, "error": repr(e)})
                continue
            nbytes = weight_bytes(layer)
            for M in batches:
                torch.manual_seed(M)
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                row = {"shape": shape, "layer": name, "N": N, "K": K, "M": M, "kernel": kind}
                try:
                    with torch.inference_mode():
                        t0 = time.perf_counter()
                        y = layer(x)  # the first call tunes (ours and GemLite's autotuners)
                        torch.cuda.synchronize()
                        row["first_call_s"] = round(time.perf_counter() - t0, 3)
                        if ref[M] is None:
                            ref[M] = x @ w.t()
                        # the quantization's own error plus the kernel's: an outlier here is a bug
                        row["rel_err"] = float((y.float() - ref[M].float()).norm() / ref[M].float().norm())
                        ms, how = gpu_time(lambda: layer(x))
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)
                    rows.append(row)
                    print(f"{shape} {name:8} M={M:<4} {kind:13} error {e!r}", flush=True)
                    continue
                row.update(us=ms * 1e3, timed=how, GBps=nbytes / (ms / 1e3) / 1e9,
                           bw_pct=100 * nbytes / (ms / 1e3) / copy_bw, weight_MB=nbytes / 1e6)
                rows.append(row)
                print(f"{shape} {name:8} M={M:<4} {kind:13} {row['us']:9.1f} us {row['GBps']:6.0f} GB/s "
                      f"({row['bw_pct']:3.0f} % of copy) err {row['rel_err']:.4f} [{how}]", flush=True)
            del layer
        del w
        torch.cuda.empty_cache()
        save()


def summarize(rows: list[dict], shapes: list[str], kinds: list[str], batches: list[int]) -> dict:
    """Per shape and batch: the step's weight time for each kind (layers x n + lm_head), its ratio
    to fp16, and the best kind per layer."""
    out = {}
    for shape in shapes:
        layers, n_layers, head = SHAPES[shape]
        for M in batches:
            us = {(r["layer"], r["kernel"]): r["us"] for r in rows
                  if r["shape"] == shape and r.get("M") == M and "us" in r}
            step = {}
            for kind in kinds:
                if all((name, kind) in us for name, _, _ in layers + [head]):
                    step[kind] = n_layers * sum(us[(name, kind)] for name, _, _ in layers) + us[(head[0], kind)]
            best = {name: min((k for k in kinds if (name, k) in us), key=lambda k: us[(name, k)], default=None)
                    for name, _, _ in layers + [head]}
            out[f"{shape} M={M}"] = {
                "step_weight_ms": {k: round(v / 1e3, 4) for k, v in step.items()},
                "vs_fp16": {k: round(step["fp16"] / v, 3) for k, v in step.items()} if "fp16" in step else {},
                "fastest_per_layer": best}
    return out


def markdown(rows: list[dict], kinds: list[str]) -> str:
    """One table per shape: a row per (layer, M), a column per kind, 'µs (% of copy)'."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lines += [f"\n{shape} shape: µs per call (% of copy bandwidth)\n",
                  "| layer (N × K) | M | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
        keys = dict.fromkeys((r["layer"], r["N"], r["K"], r["M"]) for r in rows if r["shape"] == shape and "M" in r)
        for layer, N, K, M in keys:
            cells = []
            for kind in kinds:
                r = next((r for r in rows if (r["shape"], r["layer"], r.get("M"), r["kernel"]) == (shape, layer, M, kind)), None)
                cells.append("—" if r is None or "us" not in r else f"{r['us']:.1f} ({r['bw_pct']:.0f} %)")
            lines.append(f"| {layer} {N} × {K} | {M} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(shapes: tuple[str, ...], kinds: tuple[str, ...], batches: tuple[int, ...], out: str,
        sass: str | None = None) -> None:
    """Time every (layer of `shapes`, kind, M of `batches`) and write `out`; `sass`: then count the
    instructions of every Triton kernel that ran, compiled for that arch.  UserError without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("bench kernels needs a CUDA GPU")
    kinds, skipped = available(kinds)
    for kind, why in skipped.items():
        print(f"{kind}: left out ({why})")
    copy_bw = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    rows = []
    partial = {"gpu": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "skipped": skipped, "rows": rows}
    for shape in shapes:
        run_shape(shape, kinds, batches, copy_bw, rows, save=lambda: write(out, partial))
    summary = summarize(rows, shapes, kinds, batches)
    table = markdown(rows, kinds)
    print(table)
    print(json.dumps(summary, indent=1))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_bw / 1e9,
              "skipped": skipped, "rows": rows, "summary": summary, "table": table}
    if sass:
        from quantserve.bench.sass import recompile_all

        result["sass"] = recompile_all(sass)
        print(json.dumps(result["sass"], indent=1))
    write(out, result)


def main(argv: list[str] | None = None) -> int:
    """`python -m quantserve.bench.kernels ARGS` (bench/kernels_gpu.sh runs it so) is
    `quantserve bench kernels ARGS`; returns the exit code."""
    from quantserve.bench.cli import script_main

    return script_main("kernels", argv)


if __name__ == "__main__":
    raise SystemExit(main())
