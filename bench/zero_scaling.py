"""ZeRO over several GPUs, measured: the same `quantserve train` run on 1 and on N processes.

For each ZeRO stage (2 and 3 by default) the same full fine-tune — same checkpoint, data, global
batch and number of optimizer steps; one process accumulates what N processes split — on 1 and
on N processes.  Per run: tokens/s, each GPU's peak memory and the memory it holds between steps
(its model state), next to `quantserve plan`'s prediction for that setup.  Per stage: whether the
N-process checkpoint equals the 1-process one, as the size of their difference relative to the
update the training made (||W_N - W_1|| / ||W_1 - W_0||), the loss curves and the probe logits.

    python -m bench.zero_scaling --model CKPT --seq-len 4096 --nproc 2 --out runs/zero   # GPUs
    python -m bench.zero_scaling --quick --out runs/zero-quick                         # CPU, gloo

Writes OUT/zero_scaling.json and OUT/zero_scaling.png and prints a table; `--json` copies the JSON
elsewhere.  `--replot FILE.json` redraws the PNG of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def write_data(path: Path, tokens_needed: int, seed: int = 0) -> None:
    """Random lowercase words, enough for `tokens_needed` tokens (packing cuts them into blocks)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    with path.open("w") as f:
        for _ in range(-(-tokens_needed // 1000)):  # 1000 words a line; a random word is one token or more
            words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(1000)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")


def run_train(args, zero: int, nproc: int, data: Path, out: Path) -> dict:
    cmd = [sys.executable, "-m", "quantserve", "train", "--model", str(args.model), "--data", str(data),
           "--out", str(out), "--method", "full", "--zero", str(zero), "--micro-batch", str(args.micro_batch),
           "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len), "--packing",
           "--max-steps", str(args.steps), "--save-steps", "0", "--no-resume", "--lr", str(args.lr),
           "--warmup-ratio", "0", "--quiet", *args.train_args]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    with (out.parent / f"{out.name}.log").open("w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t
    row = {"zero": zero, "nproc": nproc, "wall_s": round(wall, 1), "command": " ".join(cmd)}
    if code != 0 or not (out / "train_log.json").is_file():
        tail = (out.parent / f"{out.name}.log").read_text().strip().splitlines()[-20:]
        return {**row, "status": "failed", "exit_code": code, "error": " | ".join(tail)}
    log = json.loads((out / "train_log.json").read_text())
    steps = log["steps"]
    timed = [e["tokens_per_s"] for e in steps[args.warmup_steps:]] or [e["tokens_per_s"] for e in steps]
    mem = log.get("gpu_memory") or []
    peaks = [m["peak_gib"] for m in mem if m.get("peak_gib") is not None]
    held = [m["between_steps_gib"] for m in mem if m.get("between_steps_gib") is not None]
    return {**row, "status": "ok", "tokens_per_s": round(sorted(timed)[len(timed) // 2], 1),
            "losses": [e["loss"] for e in steps], "liger": log["resolved"]["liger"],
            "grad_ckpt": log["config"]["grad_ckpt"], "dtype": log["resolved"]["dtype"],
            "peak_gib": max(peaks) if peaks else None, "held_gib": max(held) if held else None,
            "per_rank": mem, "probe": log["probe"]["last_logits"], "global_step": log["global_step"]}


def plan_figures(args, model_config, row: dict) -> dict:
    """`quantserve plan`'s prediction for this run's setup, in GiB per GPU."""
    from quantserve.training.plan import plan_for_config

    accumulate = args.global_batch > args.micro_batch * row["nproc"]
    report = plan_for_config(model_config, seq_len=args.seq_len, micro_batch=args.micro_batch,
                             gpus=row["nproc"], method="full", liger=row["liger"],
                             accumulate=accumulate, bf16=row["dtype"] == "bfloat16")
    r = next(r for r in report.rows if r.zero == row["zero"] and r.offload == "none"
             and r.grad_ckpt == row["grad_ckpt"] and r.liger == row["liger"])
    return {"plan_peak_gib": round(r.peak / GIB, 3), "plan_params": report.params,
            "paper_state_gib": round(paper_state(row["zero"], report.params, row["nproc"]) / GIB, 3)}


def paper_state(zero: int, params: int, n: int) -> float:
    """Model-state bytes per GPU by the ZeRO paper (mixed-precision Adam, 16 bytes/param):
    ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 16Ψ/N.  Compared with what a rank holds between steps."""
    return 2 * params + 14 * params / n if zero in (1, 2) else 16 * params / n


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def compare(base: Path, ref: Path, other: Path) -> dict:
    """How far `other` is from `ref`, relative to how far training moved `ref` from `base`."""
    import torch

    w0, w1, w2 = load_weights(base), load_weights(ref), load_weights(other)
    keys = sorted(set(w0) & set(w1) & set(w2))
    diff = update = 0.0
    max_abs = 0.0
    for k in keys:
        a, b, c = w0[k].double(), w1[k].double(), w2[k].double()
        diff += float((c - b).pow(2).sum())
        update += float((b - a).pow(2).sum())
        max_abs = max(max_abs, float((c - b).abs().max()))
    return {"tensors": len(keys), "relative_diff": round((diff / max(update, 1e-30)) ** 0.5, 5),
            "max_abs_diff": max_abs, "update_norm": round(update ** 0.5, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    ap.add_argument("--out", type=Path, default=Path("runs/zero_scaling"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--zero", default="2,3")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=None, help="default: micro-batch x nproc")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tolerance", type=float, default=0.1, help="largest relative_diff counted as equal")
    ap.add_argument("--quick", action="store_true", help="CPU: default model, seq 128, 4 steps")
    ap.add_argument("--replot", type=Path, default=None, help="draw FILE.json's PNG beside it and exit")
    ap.add_argument("train_args", nargs="*", help="more `quantserve train` options, after --")
    args = ap.parse_args()
    if args.quick:
        from quantserve.bench.args import quick_sizes

        quick_sizes(args, ap, seq_len=128, steps=4, micro_batch=2, warmup_steps=1, lr=1e-3)
    if args.nproc < 1 or args.steps <= args.warmup_steps:
        ap.error("--nproc at least 1, and --steps more than --warmup-steps")
    if args.replot:
        print(plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png")))
        return
    args.global_batch = args.global_batch or args.micro_batch * args.nproc

    from transformers import AutoConfig

    import quantserve.demo  # noqa: F401  (registers "default")
    from quantserve.settings import resolve_checkpoint

    args.model = resolve_checkpoint(args.model, progress=False)
    model_config = AutoConfig.from_pretrained(str(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data.jsonl"
    write_data(data, int(args.seq_len * args.global_batch * args.steps * 1.3))

    rows, checks = [], []
    for zero in [int(z) for z in args.zero.split(",")]:
        for nproc in (1, args.nproc):
            print(f"ZeRO-{zero} on {nproc} process(es) ...", flush=True)
            row = run_train(args, zero, nproc, data, args.out / f"zero{zero}-n{nproc}")
            if row["status"] == "ok":
                row.update(plan_figures(args, model_config, row))
            rows.append(row)
            print(f"  {row['status']}: {row.get('tokens_per_s', '-')} tok/s, peak {row.get('peak_gib')} GiB, "
                  f"held {row.get('held_gib')} GiB, {row['wall_s']} s {row.get('error', '')}", flush=True)
        one, many = rows[-2], rows[-1]
        if one["status"] == many["status"] == "ok":
            c = compare(Path(args.model), args.out / f"zero{zero}-n1", args.out / f"zero{zero}-n{args.nproc}")
            n = min(len(one["losses"]), len(many["losses"]))
            c["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(one["losses"][:n], many["losses"][:n]))
            c["probe_max_abs_diff"] = max(abs(a - b) for a, b in zip(one["probe"], many["probe"]))
            c["probe_top1_equal"] = max(range(len(one["probe"])), key=one["probe"].__getitem__) == \
                max(range(len(many["probe"])), key=many["probe"].__getitem__)
            c["equal_within_tolerance"] = c["relative_diff"] <= args.tolerance
            c["speedup"] = round(many["tokens_per_s"] / one["tokens_per_s"], 3)
            if one.get("held_gib") and many.get("held_gib"):
                c["state_drop_gib"] = round(one["held_gib"] - many["held_gib"], 3)
                c["paper_state_drop_gib"] = round(one["paper_state_gib"] - many["paper_state_gib"], 3)
            checks.append({"zero": zero, **c})

    for row in rows:
        row.pop("probe", None)  # a vocabulary's worth of logits: compared above, not worth keeping
    result = {"model": str(args.model), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
              "global_batch": args.global_batch, "steps": args.steps, "nproc": args.nproc,
              "tolerance": args.tolerance, "rows": rows, "checks": checks}
    path = args.out / "zero_scaling.json"
    path.write_text(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, args.json)
    plot(result, args.out / "zero_scaling.png")
    print_table(result)


def plot(result: dict, path: Path) -> Path:
    """Two panels per run: tokens/s, and per-GPU memory (peak, held between steps, ZeRO paper)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    names = [f"ZeRO-{r['zero']}\n{r['nproc']} GPU{'s' if r['nproc'] > 1 else ''}" for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(x, [r["tokens_per_s"] for r in rows], color="tab:blue")
    a.set_xticks(list(x), names)
    a.set_ylabel("tokens/s (all GPUs)")
    a.set_title(f"throughput, global batch {result['global_batch']} x {result['seq_len']}")
    w = 0.27
    b.bar([i - w for i in x], [r.get("peak_gib") or 0 for r in rows], w, label="peak (measured)", color="tab:red")
    b.bar(list(x), [r.get("plan_peak_gib") or 0 for r in rows], w, label="peak (plan)", color="tab:pink")
    b.bar([i + w for i in x], [r.get("held_gib") or 0 for r in rows], w, label="held between steps", color="tab:green")
    b.scatter(list(x), [r.get("paper_state_gib") or 0 for r in rows], marker="_", s=900, color="black",
              label="ZeRO paper model state", zorder=3)
    b.set_xticks(list(x), names)
    b.set_ylabel("GiB per GPU")
    b.set_title("memory per GPU")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ZeRO scaling: seq {result['seq_len']}, global batch {result['global_batch']}, "
                    f"{result['steps']} steps")
    for col in ("run", "tok/s", "peak GiB", "plan peak", "held GiB", "ZeRO-paper state", "status"):
        t.add_column(col)
    for r in result["rows"]:
        f = (lambda k: f"{r[k]:.2f}" if r.get(k) is not None else "-")
        t.add_row(f"ZeRO-{r['zero']} x{r['nproc']}", f"{r.get('tokens_per_s', 0):,.0f}", f("peak_gib"),
                  f("plan_peak_gib"), f("held_gib"), f("paper_state_gib"), r["status"])
    con = Console()
    con.print(t)
    for c in result["checks"]:
        con.print(f"ZeRO-{c['zero']}: x{result['nproc']} vs x1 speedup {c['speedup']}x; checkpoint difference "
                  f"{c['relative_diff']:.4f} of the update ({'equal' if c['equal_within_tolerance'] else 'DIFFERENT'}"
                  f" at tolerance {result['tolerance']}); loss curves within {c['max_loss_rel_diff']:.2e}; "
                  f"held memory drop {c.get('state_drop_gib', '-')} GiB (ZeRO paper {c.get('paper_state_drop_gib', '-')})")


if __name__ == "__main__":
    main()
