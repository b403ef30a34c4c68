"""Weight-only matmuls per layer as a decode step meets them: µs per call, replayed from a CUDA graph
over enough distinct copies of the layer that its weights never sit in the L2 cache.

    python -m quantserve.bench.kernel_race --shapes 8b,1b --batches 1,512 --out race.json
    python -m quantserve.bench.kernel_race --old OLD_triton_gemv.py   # also the previous batch-1 kernels

A decode step reads each layer's weights once, a different layer each time: a benchmark that calls
one small layer again and again (bench/kernels.py) reads it from the 50 MB L2 cache of an H100 /
H200 and flatters the small layers.  Here the graph calls C copies in turn (C x weight bytes >= 400
MB) and the time per call is the graph's time over its calls, launch gaps between kernels included,
as in the decode step's own graph.  Kinds (as in bench/kernels.py): fp16 (cuBLAS), int8 / int4 ours
(the launcher's own choice per shape, reported with it), int8-old / int4-old (the batch-1
matrix-vector kernels of the file given by --old, at their autotuner's best config, split-K buffer
and cast included), int8-gemv / int4-gemv / int4-halfdot (batch 1: this tree's matrix-vector
kernel alone at its autotuner's config, with the bit-pattern dequantization; int4-halfdot with
its products in packed fp16; int8-dp4a / int4-dp4a with x rounded to int8 and dp4a products, triton_dp4a.py), int8-gemlite / int4-gemlite, int8-dense / int4-dense and int8-tiles / int4-tiles (prompts
only: the dequantize-then-cuBLAS path alone, the 128-row tiles alone; int8-coltiles / int4-coltiles
the same tiles with the output tiles first in the launch grid, as before ROWS_FIRST), int4-tiled (decode batches: the tiled `tl.dot`
kernel alone) and int4-rows (2-16 rows: triton_rows.py's kernel alone).  int8-w8a8 (prompts only; not a
path the server takes) rounds x to int8 with one scale per row and multiplies on the int8 tensor
cores through cuBLASLt (`torch._int_mm`; a T4 has them too, while Triton's `tl.dot` has no tensor
cores below sm_80): what a prompt could cost without an fp16 copy of the weight, and, in its
error column, what rounding the activations costs.  int8-wgmma / int4-wgmma (prompts, sm_90+):
triton_wgmma.py's TMA-fed kernels alone, at the fastest of their configs (and of MORE_CONFIGS,
which the launcher does not time) for the shape, every config's time in the row's choice;
fp16-wgmma the same tiles on the fp16 weight, nothing converted (what the tiles cost before any
dequantization).  Every row also records the error against the
fp32 product of the same integers dequantized.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

# the layer shapes and the copy bandwidth as bench/kernels.py measures them
from quantserve.bench.decode_device import copy_bandwidth
from quantserve.bench.kernels import SHAPES

KINDS = ("fp16", "fp16-wgmma", "int8", "int8-old", "int8-gemv", "int8-dp4a", "int8-gemlite", "int8-dense", "int8-tiles", "int8-coltiles", "int8-w8a8", "int8-wgmma", "int4",
         "int4-old", "int4-gemv", "int4-halfdot", "int4-dp4a", "int4-gemlite", "int4-dense", "int4-tiles", "int4-coltiles", "int4-wgmma", "int4-tiled",
         "int4-rows")
BATCH1_ONLY = ("-old", "-gemv", "-halfdot", "-dp4a", "-gemlite")  # kinds timed at M = 1 only
DECODE_ONLY = ("-tiled",)  # M <= 64 only
FEW_ROWS_ONLY = ("-rows",)  # 2 <= M <= 16 only


def _old_module(path: str | None):
    if not path or not Path(path).is_file():
        return None
    spec = importlib.util.spec_from_file_location("old_triton_gemv", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _old_layer(kind: str, layer, old):
    """x -> y through the old batch-1 kernel at its autotuned config (tuned at the first call)."""
    import torch

    from quantserve.server.fastcore import triton_mm

    tuned = old.int8_gemv_kernel if kind == "int8-old" else old.int4_gemv_kernel
    state = {}

    def call(x):
        M, K = x.shape
        N = layer.weight.shape[0]
        args = (x, layer.weight, layer.scales) if kind == "int8-old" else (x, layer.weight, layer.scales, layer.mins)
        extra = {} if kind == "int8-old" else {"GROUP": layer.group_size}
        if "config" not in state:
            out = torch.zeros((M, N), device=x.device, dtype=torch.float32)
            tuned[lambda meta: (-(-N // meta["BLOCK_N"]), meta["SPLIT_K"], 1)](
                *args, out, M, N, K, 16, x.stride(0), out.stride(0), BLOCK_M=1, **extra)
            state["config"] = tuned.best_config
        return triton_mm.run_choice(tuned.fn, state["config"], 1, M, N, K, x, args, extra)
    call.state = state
    return call


def build(kind: str, w, old):
    """(callable x -> y, weight bytes, the layer) for `kind` from an fp16 weight [N, K]."""
    import torch

    from quantserve.server.fastcore.quant import linear_weight_bytes, make_linear

    if kind in ("fp16", "fp16-wgmma"):
        layer = make_linear(w, None, "none", torch.float16)
        return (_wgmma_layer(layer) if kind == "fp16-wgmma" else layer), linear_weight_bytes(layer), layer
    weights, _, library = kind.partition("-")
    layer = make_linear(w, None, weights, torch.float16, "gemlite" if library == "gemlite" else "triton")
    fn = {"old": lambda: _old_layer(kind, layer, old), "dense": lambda: _dense_layer(layer),
          "tiles": lambda: _alone(layer, "tiles"), "coltiles": lambda: _alone(layer, "tiles", {"ROWS_FIRST": False}),
          "w8a8": lambda: _w8a8_layer(layer), "wgmma": lambda: _wgmma_layer(layer), "gemv": lambda: _alone(layer, "gemv", {"BIT_DEQUANT": True}),
          "tiled": lambda: _alone(layer, "tiled"), "rows": lambda: _alone(layer, "rows"),
          "halfdot": lambda: _alone(layer, "gemv", {"BIT_DEQUANT": True, "HALF_DOT": True}),
          "dp4a": lambda: _alone(layer, "gemv", {"BIT_DEQUANT": True, "DOT4": True})}.get(library, lambda: layer)()
    return fn, linear_weight_bytes(layer), layer


def _dense_layer(layer):
    """x -> y by the prompt path's dequantize-then-cuBLAS alone (the launcher times it against the
    tiles; this row shows its time whichever wins, as a GPU without tensor-core Triton would run it)."""
    from quantserve.server.fastcore import triton_mm

    if hasattr(layer, "mins"):
        return lambda x: triton_mm._int4_dense(x, layer.weight, layer.scales, layer.mins, layer.group_size)
    return lambda x: triton_mm._int8_dense(x, layer.weight, layer.scales)


def _rows_to_int8(x):
    """x [M, K] -> (int8 [M, K], fp32 scales [M, 1]): one symmetric scale per row, max|x| / 127."""
    scale = x.float().abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
    return (x.float() / scale).round().clamp(-127, 127).char(), scale


def _scaled(acc, row_scales, col_scales, dtype):
    """int32 [M, N] products -> [M, N] in dtype, times each row's and each column's scale."""
    return (acc.float() * row_scales * col_scales.float()).to(dtype)


_compiled: dict = {}


def _w8a8_layer(layer):
    """x -> y with x rounded to int8 per row, int8 x int8 -> int32 on cuBLASLt (`torch._int_mm`, the
    weight's [N, K] buffer read as its column-major transpose), then both scales in one pass.  The
    rounding and the scaling are compiled (one kernel each), as a server would run them."""
    import torch

    if not _compiled:
        _compiled.update(rows=torch.compile(_rows_to_int8, dynamic=True), scaled=torch.compile(_scaled, dynamic=True))
    weight_t = layer.weight.t()

    def call(x):
        xq, row_scales = _compiled["rows"](x)
        return _compiled["scaled"](torch._int_mm(xq, weight_t), row_scales, layer.scales, x.dtype)
    return call


def _wgmma_name(c) -> str:
    return "{BLOCK_N}x{BLOCK_M}x{BLOCK_K}".format(**c.kwargs) + f" w{c.num_warps} s{c.num_stages}"


_wgmma_chosen: dict = {}  # (int4, float weight, N, K, M) -> the state of the first copy that timed the configs


def _wgmma_layer(layer):
    """x -> y by triton_wgmma's kernels alone (sm_90+), at the config that timed fastest for this M
    (every candidate's time kept in `call.state["times"]`)."""
    from quantserve.server.fastcore import triton_wgmma as wg
    from quantserve.server.fastcore.kernel_timing import graph_times

    int4, floating = hasattr(layer, "mins"), layer.weight.is_floating_point()
    N, K = layer.weight.shape[0], layer.weight.shape[1] * (2 if int4 else 1)
    state = {}

    def on(config):
        if floating:
            return lambda x: wg.float_wgmma_mm(x, layer.weight, config)
        if int4:
            return lambda x: wg.int4_wgmma_mm(x, layer.weight, layer.scales, layer.mins, layer.group_size, config)
        return lambda x: wg.int8_wgmma_mm(x, layer.weight, layer.scales, config)

    def call(x):
        M = x.shape[0]
        if M not in state and (int4, floating, N, K, M) in _wgmma_chosen:  # another copy of this layer timed them
            state.update(_wgmma_chosen[int4, floating, N, K, M])
        if M not in state:
            configs = wg.configs_for(K, layer.group_size if int4 else None, more=True)
            calls, kept = [], []
            for c in configs:
                try:
                    on(c)(x)
                    calls.append(lambda c=c: on(c)(x))
                    kept.append(c)
                except Exception as e:  # noqa: BLE001  (a config this Triton cannot compile: recorded)
                    state.setdefault("errors", []).append(f"{c}: {e!r}"[:300])
            times = graph_times(calls)
            state[M] = kept[min(range(len(kept)), key=times.__getitem__)]
            state["times"] = {_wgmma_name(c): round(t * 1e3, 1) for c, t in zip(kept, times)}
            _wgmma_chosen[int4, floating, N, K, M] = dict(state)
        state["config"] = state[M]
        return on(state[M])(x)
    call.state = state
    return call


def _alone(layer, kind: str, flags: dict | None = None):
    """x -> y by one of our kernels alone, at its autotuner's best config for this shape (the
    launcher may keep another kind; this row shows this one): "tiles", the 128-row prompt tiles
    (with flags {"ROWS_FIRST": False}, "coltiles": the config the tiles tuned to, its grid in the
    order before ROWS_FIRST: the difference is the grid order alone);
    "gemv", this tree's batch-1 matrix-vector kernel with `flags`; "tiled", the decode batches' tiled
    kernel; "rows", the int4 few-rows kernel.  Tuned once per M."""
    from quantserve.server.fastcore import triton_gemv, triton_mm, triton_rows

    int4 = hasattr(layer, "mins")
    args = (layer.weight, layer.scales) + ((layer.mins,) if int4 else ())
    extra = {"GROUP": layer.group_size} if int4 else {}
    state = {}

    def kernel(M: int):
        if kind == "tiles":
            return (triton_mm.int4_prompt_kernel if int4 else triton_mm.int8_prompt_kernel), triton_mm.PROMPT_BLOCK_M
        if kind == "tiled":
            return (triton_mm.int4_kernel if int4 else triton_mm.int8_kernel), triton_mm._block_m(M)
        if kind == "rows":
            return triton_rows.int4_rows_kernel, triton_rows.block_m(M)
        return (triton_gemv.int4_gemv_kernel if int4 else triton_gemv.int8_gemv_kernel), 1

    def call(x):
        M, K = x.shape
        N = layer.weight.shape[0]
        tuned, block_m = kernel(M)
        if M not in state:
            bucket = triton_mm._m_bucket(M, fine=int4)
            state[M] = triton_mm._tune(tuned, block_m, M, N, K, x, (x, *args), extra, bucket)
        fn, config, _, _ = state[M]
        state["config"] = config
        return triton_mm.run_choice(fn, config, block_m, M, N, K, x, (x, *args), {**extra, **(flags or {})})
    call.state = state
    return call


def dequantized(w) -> dict:
    """kind prefix -> the fp32 weight every kind of that prefix computes with: the integers are
    made by the same quantizer for ours, the old kernels and GemLite (which repacks them)."""
    import torch

    from quantserve.server.fastcore.quant import make_linear

    q8, q4 = (make_linear(w, None, mode, torch.float16, "torch") for mode in ("int8", "int4"))
    return {"fp16": w.float(), "int8": q8.weight.float() * q8.scales.float()[:, None],
            "int4": q4.dequantize(torch.float32)}


def graph_us(calls, x, replays: int = 5) -> float:
    """µs per call: one CUDA graph calling each of `calls` once on x, best of `replays` replays."""
    import torch

    from quantserve.server.fastcore.kernel_timing import best_replay_ms

    for fn in calls:  # first calls outside the capture (autotuning, allocations)
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn(x)
    best = best_replay_ms(graph, replays) * 1e3 / len(calls)
    del graph
    return best


def describe_choice(kind: str, fn, N: int, K: int, M: int) -> str | None:
    from quantserve.server.fastcore import triton_mm

    if kind in ("int8", "int4"):
        c = triton_mm.chosen(kind, M, N, K)
        if c is None:
            return None
        f, config, block_m, flags = c
        name = getattr(f, "__name__", None) or getattr(getattr(f, "fn", None), "__name__", str(f))
        return f"{name} {config.kwargs if config is not None else 'dense'} w{getattr(config, 'num_warps', '-')} {flags}"
    if kind.endswith("-wgmma"):
        c = fn.state.get("config")
        return f"wgmma {_wgmma_name(c)} of {fn.state.get('times')} {fn.state.get('errors', '')}" if c is not None else None
    if kind.endswith(("-old", "-tiles", "-coltiles", "-gemv", "-halfdot", "-dp4a", "-tiled", "-rows")):
        c = fn.state.get("config")
        return f"{kind.split('-')[1]} {c.kwargs} w{c.num_warps} s{c.num_stages}" if c is not None else None
    return None


def run(shapes, kinds, batches, out: str, old_path: str | None, budget_mb: int = 400, only=None) -> dict:
    import torch

    from quantserve.server.fastcore.quant import gemlite_available

    old = _old_module(old_path)
    kinds = [k for k in kinds if not (k.endswith("-old") and old is None)
             and not (k.endswith("-gemlite") and not gemlite_available())]
    bw = copy_bandwidth(torch.device("cuda"))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": bw / 1e9,
              "kinds": kinds, "rows": []}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {result['gpu']}; kinds {kinds}", flush=True)
    for shape in shapes:
        layers, _, head = SHAPES[shape]
        for name, N, K in layers + [head]:
            if only and name not in only:
                continue
            fp16_bytes = 2 * N * K
            copies = max(1, min(16, -(-budget_mb * 10**6 // (fp16_bytes // 2))))
            torch.manual_seed(0)
            ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
            for kind in kinds:
                t0 = time.perf_counter()
                try:
                    built = [build(kind, w, old) for w in ws]
                except Exception as e:  # noqa: BLE001  (a library refusing a shape: recorded, the run goes on)
                    result["rows"].append({"shape": shape, "layer": name, "kind": kind, "error": repr(e)[:300]})
                    continue
                fns, nbytes = [b[0] for b in built], built[0][1]
                ref_w = dequantized(ws[0])[kind.split("-")[0]]
                for M in batches:
                    if M > 1 and kind.endswith(BATCH1_ONLY):
                        continue  # batch-1 kernels (ours alone, old) / GemLite's own per-M tuning: batch 1 only here
                    if M <= 64 and kind.endswith(("-dense", "-tiles", "-coltiles", "-w8a8", "-wgmma")):
                        continue  # a prompt path
                    if (M > 64 and kind.endswith(DECODE_ONLY)) or (not 2 <= M <= 16 and kind.endswith(FEW_ROWS_ONLY)):
                        continue
                    torch.manual_seed(M)
                    x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                    row = {"shape": shape, "layer": name, "N": N, "K": K, "M": M, "kind": kind, "copies": copies}
                    try:
                        with torch.inference_mode():
                            y = fns[0](x)
                            torch.cuda.synchronize()
                            row["first_call_s"] = round(time.perf_counter() - t0, 2)
                            ref = x.float() @ ref_w.t()
                            row["rel_err"] = float((y.float() - ref).norm() / ref.norm())
                            us = graph_us(fns, x)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = repr(e)[:300]
                        result["rows"].append(row)
                        print(f"{shape} {name:8} M={M:<4} {kind:13} error {e!r}"[:300], flush=True)
                        continue
                    row.update(us=us, bw_pct=100 * nbytes / (us / 1e6) / bw, weight_MB=nbytes / 1e6,
                               choice=describe_choice(kind, fns[0], N, K, M))
                    result["rows"].append(row)
                    print(f"{shape} {name:8} M={M:<4} {kind:13} {us:8.1f} us ({row['bw_pct']:3.0f} % of copy) "
                          f"err {row['rel_err']:.4f}  {row['choice'] or ''}", flush=True)
                    Path(out).write_text(json.dumps(result, indent=1))
                del built, fns, ref_w
            del ws
            torch.cuda.empty_cache()
    result["table"] = markdown(result)
    print(result["table"])
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if "us" in r]
    kinds = result["kinds"]
    lines = ["| layer (N × K) | M | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for shape, name, N, K, M in dict.fromkeys((r["shape"], r["layer"], r["N"], r["K"], r["M"]) for r in rows):
        cells = []
        for kind in kinds:
            r = next((r for r in rows if (r["shape"], r["layer"], r["M"], r["kind"]) == (shape, name, M, kind)), None)
            cells.append("—" if r is None else f"{r['us']:.1f} ({r['bw_pct']:.0f} %)")
        lines.append(f"| {shape} {name} {N} × {K} | {M} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.kernel_race", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b,1b", help="comma list of 8b, 1b")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--batches", default="1", help="comma list of M (rows of x); the -old and -gemlite kinds run at 1 only")
    ap.add_argument("--old", default=None, help="a previous triton_gemv.py whose batch-1 kernels to time beside ours")
    ap.add_argument("--layers", default="", help="comma list of layer names to time (default: every layer and lm_head)")
    ap.add_argument("--out", default="bench/results/kernel_race.json", help="JSON file to write")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.exit(1, "error: kernel_race needs a CUDA GPU\n")
    run([s for s in args.shapes.split(",") if s], [k for k in args.kinds.split(",") if k],
        [int(b) for b in args.batches.split(",") if b], args.out, args.old,
        only={n for n in args.layers.split(",") if n})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
