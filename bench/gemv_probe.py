"""Where the int4 batch-1 kernel's time goes: the kernel with one stage at a time left out, or done
another way, timed per 8B layer as a decode step meets it (a CUDA graph over copies of the layer
that do not fit the L2 cache).

    python -m quantserve.bench.gemv_probe --out probe.json            # every variant, every layer
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        python -m quantserve.bench.gemv_probe --ncu                   # the shipped form, counters

A kernel's time cannot be split by counters alone on every machine (ncu needs one that lets it read
them); leaving a stage out and taking the difference can (the device notes' method).  The probe
kernel is `triton_gemv._int4_gemv_kernel`'s dp4a path without the fused forms (and without the
shared-memory exchanges Triton puts in its K loop: _word_columns), with switches:

- SZ: the scales and zero points: 0 loaded each step as the served kernel does (two 2-byte loads a
  word and row); 1 not loaded (constants: wrong sums, the loads' cost); 2 one 4-byte load of the
  (scale, zero) pair, as if stored interleaved; 3 the pair loaded a step ahead with the words.
- XQ: x: 0 rounded to int8 in the kernel by every program (8 loads and ~35 instructions a word
  column); 1 rounded once beforehand (two int32 of packed bytes, the scale and the column sum
  loaded); 2 none (constants: the cost of x altogether).
- DOT: 1 the dp4a products; 0 none (the words reinterpreted as floats: the loads alone).

Variants with constants give wrong sums and say so in their row; the others are checked against
the served form's output.  Not used by the server: what it finds goes into triton_gemv.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import triton
import triton.language as tl

from quantserve.server.fastcore.triton_dequant import PTX, first_words, step_words
from quantserve.server.fastcore.triton_dp4a import column_sum, dot_int4, quantize8_for_nibbles


@triton.jit
def _word_columns(W: tl.constexpr):
    """tl.arange(0, W) with its alignment hidden from the compiler (an opaque zero added in PTX), so
    the words' loads get the scales' and x's register layout and no K step goes through shared
    memory (Triton 3.6 otherwise puts 2 words a thread, the warps over K and rows: 6 barriers a
    step in the sm_90 SASS).  Measured on an H200 in the served kernels: no gain (bench/RESULTS.md),
    so only this probe keeps it, to time the stages without the barriers."""
    rw = tl.arange(0, W)
    if PTX:
        rw += tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tl.zeros((1,), tl.int32)], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return rw


@triton.jit
def _pair_halves(pair):
    """An int32 of two fp16 (low half, high half) -> both as fp32."""
    lo = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit(do_not_specialize_on_alignment=["K"])
def probe_kernel(x_ptr, xl_ptr, xh_ptr, xs_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, sz_ptr, out_ptr, N, K,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SZ: tl.constexpr,
                 XQ: tl.constexpr, DOT: tl.constexpr):
    W: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1)
    rw = tl.arange(0, W)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + _word_columns(W)[:, None] + rows[None, :] * (K // 8)
    sz_off = (8 * rw[:, None]) // GROUP + rows[None, :] * (K // GROUP)
    acc = tl.zeros((W, BLOCK_N), dtype=tl.float32)
    ahead = first_words(w_ptrs, 0, 8, True)
    if SZ == 3:
        pair_ahead = tl.load(sz_ptr + sz_off)
    for k in range(0, K, BLOCK_K):
        k = tl.multiple_of(k, BLOCK_K)
        words, ahead = step_words(w_ptrs, k, K, ahead, BLOCK_K, 8, True)
        if SZ == 0:
            s = tl.load(s_ptr + sz_off + k // GROUP).to(tl.float32)
            z = tl.load(z_ptr + sz_off + k // GROUP).to(tl.float32)
        elif SZ == 1:
            s = tl.full((W, BLOCK_N), 0.01, tl.float32)
            z = tl.full((W, BLOCK_N), -0.08, tl.float32)
        elif SZ == 2:
            s, z = _pair_halves(tl.load(sz_ptr + sz_off + k // GROUP))
        else:
            s, z = _pair_halves(pair_ahead)
            live = tl.full((1,), k + BLOCK_K, tl.int32) < K
            pair_ahead = tl.load(sz_ptr + sz_off + (k + BLOCK_K) // GROUP, mask=live, other=0)
        if XQ == 0:
            c = k + 8 * rw
            low, high, xs = quantize8_for_nibbles(
                tl.load(x_ptr + c).to(tl.float32), tl.load(x_ptr + c + 1).to(tl.float32),
                tl.load(x_ptr + c + 2).to(tl.float32), tl.load(x_ptr + c + 3).to(tl.float32),
                tl.load(x_ptr + c + 4).to(tl.float32), tl.load(x_ptr + c + 5).to(tl.float32),
                tl.load(x_ptr + c + 6).to(tl.float32), tl.load(x_ptr + c + 7).to(tl.float32))
            xsum = column_sum(low, high) * xs
        elif XQ == 1:
            low = tl.load(xl_ptr + k // 8 + rw)
            high = tl.load(xh_ptr + k // 8 + rw)
            xs = tl.load(xs_ptr + k // 8 + rw)
            xsum = tl.load(xsum_ptr + k // 8 + rw)
        else:
            low = tl.full((W,), 0x01020304, tl.int32)
            high = tl.full((W,), 0x05060708, tl.int32)
            xs = tl.full((W,), 0.01, tl.float32)
            xsum = tl.full((W,), 0.3, tl.float32)
        if DOT:
            part = dot_int4(words, tl.broadcast_to(low[:, None], (W, BLOCK_N)),
                            tl.broadcast_to(high[:, None], (W, BLOCK_N))) * xs[:, None]
        else:
            part = words.to(tl.float32, bitcast=True) * xs[:, None]
        acc += part * s
        acc += xsum[:, None] * z
    tl.store(out_ptr + rn, tl.sum(acc, axis=0), mask=rn < N)


def round_x(x):
    """x [K] -> (low, high int32 [K / 8], scale fp32 [K / 8], column sum fp32 [K / 8]): x rounded to
    int8 per 8 columns as triton_dp4a.quantize8_for_nibbles does (round half to even, max|x| / 127)."""
    import torch

    g = x.float().view(-1, 8)
    scale = g.abs().amax(1).clamp_min(1e-30) / 127
    q = torch.round(g * (127 / g.abs().amax(1).clamp_min(1e-30))[:, None]).to(torch.int32)
    b = q & 0xFF

    def pack(c):
        return b[:, c[0]] | (b[:, c[1]] << 8) | (b[:, c[2]] << 16) | (b[:, c[3]] << 24)
    return (pack((1, 3, 5, 7)).contiguous(), pack((0, 2, 4, 6)).contiguous(), scale.contiguous(),
            (q.sum(1).float() * scale).contiguous())


VARIANTS = {  # name -> (SZ, XQ, DOT, what it is)
    "served": (0, 0, 1, "as served"),
    "sz-pair": (2, 0, 1, "(scale, zero) one 4-byte load"),
    "sz-pair-ahead": (3, 0, 1, "(scale, zero) pair a step ahead"),
    "x-prerounded": (0, 1, 1, "x rounded beforehand"),
    "pair+prerounded": (2, 1, 1, "both"),
    "pair-ahead+prerounded": (3, 1, 1, "both, pair ahead"),
    "no-sz": (1, 0, 1, "no scale / zero loads (wrong sums)"),
    "no-x": (0, 2, 1, "no x at all (wrong sums)"),
    "loads-only": (1, 2, 0, "words only, no products (wrong sums)"),
}
EXACT = ("served", "sz-pair", "sz-pair-ahead", "x-prerounded", "pair+prerounded", "pair-ahead+prerounded")


def _layer_args(layer, x):
    import torch

    low, high, xs, xsum = round_x(x[0])
    pair = (layer.scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | \
        (layer.mins.contiguous().view(torch.int16).to(torch.int32) << 16)
    return dict(x=x, low=low, high=high, xs=xs, xsum=xsum, w=layer.weight, s=layer.scales, z=layer.mins,
                sz=pair.contiguous(), group=layer.group_size)


def launch(a: dict, variant: str, block_n: int, block_k: int, warps: int):
    import torch

    SZ, XQ, DOT, _ = VARIANTS[variant]
    N, K = a["w"].shape[0], a["w"].shape[1] * 2
    out = torch.empty(N, device=a["x"].device, dtype=torch.float32)
    probe_kernel[(triton.cdiv(N, block_n),)](
        a["x"], a["low"], a["high"], a["xs"], a["xsum"], a["w"], a["s"], a["z"], a["sz"], out, N, K,
        GROUP=a["group"], BLOCK_N=block_n, BLOCK_K=block_k, SZ=SZ, XQ=XQ, DOT=DOT, num_warps=warps,
        num_stages=1)
    return out


CONFIGS = ((8, 1024, 4), (16, 1024, 4))


def run(out_path: str, layers_only=None, variants=None, ncu: bool = False) -> dict:
    import torch

    from quantserve.bench.decode_device import copy_bandwidth
    from quantserve.bench.kernel_race import graph_us
    from quantserve.bench.kernels import SHAPES
    from quantserve.server.fastcore.quant import linear_weight_bytes, make_linear

    bw = copy_bandwidth(torch.device("cuda"))
    result = {"gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "rows": []}
    layers, _, head = SHAPES["8b"]
    for name, N, K in layers + [head]:
        if layers_only and name not in layers_only:
            continue
        copies = max(1, min(16, -(-400 * 10**6 // (N * K // 2))))
        torch.manual_seed(0)
        built = [make_linear(torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02, None, "int4",
                             torch.float16, "triton") for _ in range(copies)]
        nbytes = linear_weight_bytes(built[0])
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        args = [_layer_args(layer, x) for layer in built]
        if ncu:  # the served form at each config, once each, between the profiler's start and stop
            for bn, bk, w in CONFIGS:
                launch(args[0], "served", bn, bk, w)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for bn, bk, w in CONFIGS[:2]:
                launch(args[1 % copies], "served", bn, bk, w)
            launch(args[1 % copies], "x-prerounded", 8, 1024, 4)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        reference = launch(args[0], "served", 8, 1024, 4)
        for variant in variants or VARIANTS:
            for bn, bk, w in CONFIGS:
                if K % bk:
                    continue
                y = launch(args[0], variant, bn, bk, w)
                err = float((y - reference).abs().max() / reference.abs().max())
                us = graph_us([lambda _x, a=a: launch(a, variant, bn, bk, w) for a in args], x)
                row = {"layer": name, "N": N, "K": K, "variant": variant, "config": [bn, bk, w], "us": us,
                       "bw_pct": 100 * nbytes / (us / 1e6) / bw, "max_rel_diff": err,
                       "exact": variant in EXACT}
                result["rows"].append(row)
                print(f"{name:8} {variant:22} {bn:>2}x{bk:<4} w{w}  {us:7.1f} us ({row['bw_pct']:3.0f} %)  "
                      f"diff {err:.1e}{'' if row['exact'] else ' (wrong sums by design)'}", flush=True)
                Path(out_path).write_text(json.dumps(result, indent=1))
        del built, args
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.gemv_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/gemv_probe.json")
    ap.add_argument("--layers", default="", help="comma list of qkv, o, gate_up, down, lm_head (default all)")
    ap.add_argument("--variants", default="", help=f"comma list of {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--ncu", action="store_true", help="launch the served form under the profiler's start/stop only")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        ap.exit(1, "error: gemv_probe needs a CUDA GPU\n")
    run(args.out, {n for n in args.layers.split(",") if n}, [v for v in args.variants.split(",") if v], args.ncu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
