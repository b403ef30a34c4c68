"""What an int8 KV cache costs in quality: the fast core with `kv_cache_dtype="int8"` against the
same core with its cache in the model's own dtype, on the same held-out token windows.

Each window is prefilled in one forward with every position's logits (the prompt's own keys and
values are written to the cache and read back from it, so the int8 rounding is in them), then
    top-1 agreement   how often both caches give the same most likely next token,
    perplexity        of the held-out text under each, and the relative change,
    max |Δ logit|     the largest logit difference, over every position.

    python -m quantserve.bench.kv_quality                 # the embedded default model
    python -m quantserve.bench.kv_quality --shape 1b      # random weights of the Llama-3.2-1B layout

Runs on a CPU (fp32 there; fp16 on a GPU).  Random weights make a near-uniform next-token
distribution, so for the 1B shape agreement is a harder test than for a trained model.
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
    return {"positions": total, "top1_agreement": round(agree / total, 4), "ppl_auto": round(ppl_ref, 4),
            "ppl_int8": round(ppl_got, 4), "ppl_change_pct": round(100 * (ppl_got / ppl_ref - 1), 3),
            "max_abs_logit_diff": float(f"{worst:.3g}")}


def run(shape: str | None, n_windows: int, length: int) -> dict:
    import torch

    import quantserve.demo  # noqa: F401  (registers the default model's held-out text)
    from quantserve.demo.default_model import default_model_path
    from quantserve.modeling import load_tokenizer
    from quantserve.server.fastcore import FastCore

    torch.set_grad_enabled(False)
    default = default_model_path(progress=False)
    tokenizer = load_tokenizer(default)
    wins = windows(tokenizer, n_windows, length)
    if shape is None:
        make = lambda kv: FastCore(str(default), max_slots=1, max_seq=length, compile=False, kv_cache_dtype=kv)  # noqa: E731
        label = "default model"
    else:
        from quantserve.bench.decode import model_config

        cfg = model_config(shape)
        make = lambda kv: FastCore(None, random_config=cfg, max_slots=1, max_seq=length, compile=False,  # noqa: E731
                                   kv_cache_dtype=kv)
        label = f"{shape} shape, random weights"
    ref = score(make("auto"), wins)
    core = make("int8")
    row = {"model": label, "dtype": str(core.dtype).replace("torch.", ""), "device": str(core.device),
           "windows": len(wins), "window_tokens": length, **compare(ref, score(core, wins), wins)}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quantserve.bench.kv_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default=None, help="a bench decode shape (1b, 8b, ...) with random weights; "
                    "default: the embedded default model")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows scored")
    ap.add_argument("--length", type=int, default=256, help="tokens per window")
    args = ap.parse_args(argv)
    print(json.dumps(run(args.shape, args.windows, args.length), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
