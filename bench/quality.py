"""What the fast core's quantization costs in quality: an int8 KV cache (`kv_cache_dtype="int8"`)
or int8 / int4 weights (`weight_quant`), each against the same core unquantized, on the same
held-out token windows.

Each window is prefilled in one forward with every position's logits (the prompt's own keys and
values are written to the cache and read back from it, so the int8 KV rounding is in them), then
    top-1 agreement   how often both give the same most likely next token,
    perplexity        of the held-out text under each, and the relative change,
    max |Δ logit|     the largest logit difference, over every position.

    python -m quantserve.bench.quality                       # int8 KV cache, the embedded default model
    python -m quantserve.bench.quality --shape 1b            # random weights of the Llama-3.2-1B layout
    python -m quantserve.bench.quality --weights int4        # int4 weights (group 128), KV cache as the model
    python -m quantserve.bench.quality --weights int4 --decode   # the same, one token per step (batch 1)
    python -m quantserve.bench.quality --weights int8 --round-x-to-int8  # CPU: x rounded as the dp4a kernels do

--decode scores each window one token per step instead (its first token as a prompt, then each
next one fed as a decode step of batch 1, teacher-forced): on a GPU that is the batch-1 path, whose
int8 / int4 kernels take in the norms, the gate and the residual adds, and whose int4 kernel may
multiply in packed fp16 (fastcore/fused.py, triton_gemv.py); a window's prefill does not run it.

Runs on a CPU (fp32 there; fp16 on a GPU).  The weights' integers and scales are the same on both:
a CPU dequantizes and multiplies in torch, a GPU runs the Triton kernels, which match that to
~1e-4 of the outputs' scale (tests/serve/test_gpu_kernels.py), so the CPU measures what the
format costs.  Random weights make a near-uniform next-token distribution, so for the 1B shape
agreement is a harder test than for a trained model.
"""

from __future__ import annotations

import argparse
import json
import math


def windows(tokenizer, n: int, length: int) -> list[list[int]]:
    from quantserve.quant.evaluate import heldout_documents, token_windows

    docs, _ = heldout_documents(None, tokenizer)
    return token_windows(tokenizer, docs, length)[:n]


def score(core, wins: list[list[int]]):
    """Every window's logits [n - 1, vocab] (predicting positions 1..n-1), as float64 numpy."""
    out = []
    slot = core.acquire()
    try:
        for ids in wins:
            out.append(core.prefill(slot, ids, all_logits=True)[:-1].double().cpu().numpy())
            core.release(slot)
            slot = core.acquire()
    finally:
        core.release(slot)
    return out


def score_decoding(core, wins: list[list[int]]):
    """As `score`, one token per forward: the logits after each of a window's tokens but the last,
    every step a batch-1 decode."""
    import torch

    out = []
    for ids in wins:
        slot = core.acquire()
        try:
            rows = [core.prefill(slot, ids[:1])]
            rows += [core.decode([slot], [t])[0] for t in ids[1:-1]]
        finally:
            core.release(slot)
        out.append(torch.stack(rows).double().cpu().numpy())
    return out


def compare(ref, got, wins) -> dict:
    import numpy as np

    agree = total = 0
    nll_ref = nll_got = 0.0
    worst = 0.0
    for r, g, ids in zip(ref, got, wins):
        target = np.array(ids[1:])
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        total += len(target)
        for logits, acc in ((r, "ref"), (g, "got")):
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            nll = float((lse - logits[np.arange(len(target)), target]).sum())
            if acc == "ref":
                nll_ref += nll
            else:
                nll_got += nll
        worst = max(worst, float(np.abs(r - g).max()))
    ppl_ref, ppl_got = math.exp(nll_ref / total), math.exp(nll_got / total)
    return {"positions": total, "top1_agreement": round(agree / total, 4), "ppl_reference": round(ppl_ref, 4),
            "ppl_quantized": round(ppl_got, 4), "ppl_change_pct": round(100 * (ppl_got / ppl_ref - 1), 3),
            "max_abs_logit_diff": float(f"{worst:.3g}")}


def run(shape: str | None, n_windows: int, length: int, weights: str = "none", kv: str = "int8",
        decoding: bool = False, round_x: bool = False) -> dict:
    """One comparison: weights `weights` ("none", "int8", "int4") with a KV cache of `kv` ("auto":
    the model's dtype, or "int8") against no quantization at all; `decoding`: one token a step;
    `round_x`: the quantized layers' inputs rounded to int8 as the dp4a kernels do (CPU only)."""
    import contextlib

    import torch

    with torch.no_grad(), (rounded_x() if round_x else contextlib.nullcontext()):
        # no_grad here, not process-wide: a caller in the same process keeps its grad mode
        row = _compare(shape, n_windows, length, weights, kv, decoding)
    return {**row, "x_rounded_to_int8": round_x}


def _round(x, group: int):
    """x rounded to int8 with one scale per `group` columns: max|x| / 127 (triton_dp4a.py's grid)."""
    g = x.float().reshape(*x.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (g / scale).round().mul(scale).reshape(x.shape).to(x.dtype)


def rounded_x():
    """The batch-1 dp4a kernels' numerics (server/fastcore/triton_dp4a.py) on a CPU, in torch: each
    int8 layer's input rounded per 4 columns, each int4 layer's per 8, before the layer (int4's
    zero-point term too, as the kernel takes it).  On a GPU the kernels run it."""
    import contextlib

    from quantserve.server.fastcore import quant

    int8_forward, int4_forward = quant.Int8Linear.forward, quant.Int4Linear.forward

    def int8(self, x):
        return int8_forward(self, _round(x, 4))

    def int4(self, x):
        return int4_forward(self, _round(x, 8))

    @contextlib.contextmanager
    def patched():
        quant.Int8Linear.forward, quant.Int4Linear.forward = int8, int4
        try:
            yield
        finally:
            quant.Int8Linear.forward, quant.Int4Linear.forward = int8_forward, int4_forward
    return patched()


def _compare(shape: str | None, n_windows: int, length: int, weights: str, kv: str, decoding: bool) -> dict:
    import torch

    import quantserve.demo  # noqa: F401  (registers the default model's held-out text)
    from quantserve.demo.default_model import default_model_path
    from quantserve.modeling import load_tokenizer
    from quantserve.server.fastcore import FastCore

    default = default_model_path(progress=False)
    tokenizer = load_tokenizer(default)
    wins = windows(tokenizer, n_windows, length)
    if shape is None:
        source = {"model": str(default)}
        label = "default model"
    else:
        from quantserve.bench.decode import model_config

        source = {"model": None, "random_config": model_config(shape)}
        label = f"{shape} shape, random weights"

    def make(weight_quant: str, kv_cache_dtype: str):
        return FastCore(**source, max_slots=1, max_seq=length, compile=False, weight_quant=weight_quant,
                        kv_cache_dtype=kv_cache_dtype)

    scorer = score_decoding if decoding else score
    ref = scorer(make("none", "auto"), wins)
    core = make(weights, kv)
    row = {"model": label, "weights": weights, "kv_cache": kv, "dtype": str(core.dtype).replace("torch.", ""),
           "device": str(core.device), "windows": len(wins), "window_tokens": length,
           "scored": "one token a step (batch-1 decode)" if decoding else "each window in one prefill",
           **compare(ref, scorer(core, wins), wins)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.quality", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="a bench decode shape (1b, 8b, ...) with random weights; "
                    "default: the embedded default model")
    ap.add_argument("--weights", choices=("none", "int8", "int4"), default="none",
                    help="weight quantization to measure (default: none)")
    ap.add_argument("--kv", choices=("auto", "int8"), default=None,
                    help="KV cache to measure (default: int8 when --weights is none, else the model's dtype)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows scored")
    ap.add_argument("--length", type=int, default=256, help="tokens per window")
    ap.add_argument("--decode", action="store_true", help="score one token per step (batch-1 decode steps) "
                    "instead of each window in one prefill")
    ap.add_argument("--round-x-to-int8", action="store_true", help="CPU: the quantized layers' inputs rounded "
                    "to int8 as the batch-1 dp4a kernels do (emulated in torch; on a GPU the kernels run it)")
    args = ap.parse_args(argv)
    kv = args.kv or ("int8" if args.weights == "none" else "auto")
    if args.round_x_to_int8 and args.weights == "none":
        ap.error("--round-x-to-int8 needs --weights int8|int4 (it rounds the quantized layers' inputs)")
    if args.round_x_to_int8:
        import torch

        if torch.cuda.is_available():
            ap.error("--round-x-to-int8 emulates the dp4a kernels on a CPU; on a GPU they run for real "
                     "(--decode, wherever the launcher keeps them)")
    if args.weights == "none" and kv == "auto":
        ap.error("nothing to measure: give --weights int8|int4 or --kv int8")
    if args.windows < 1 or args.length < 2:
        ap.error("--windows must be >= 1 and --length >= 2 (a window predicts its tokens after the first)")
    print(json.dumps(run(args.shape, args.windows, args.length, args.weights, kv, args.decode, args.round_x_to_int8),
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
