"""Plot serving results: output throughput, median time to first token and p99 TPOT against
concurrency, one line per JSON; or (`--ttft-cdf`) every request's time to first token, sorted, for
runs saved with `bench serve --save-records` (a shared-prefix load: how many requests waited how long).

    quantserve bench plot bench/results/serve-ours.json bench/results/serve-llamacpp.json -o serve.png
    quantserve bench plot ours-shared.json ours-nocache-shared.json --ttft-cdf -o shared.png
"""

from __future__ import annotations

import json
from pathlib import Path


def load_result(path: str) -> dict:
    """A `bench serve` JSON, or ValueError naming the file."""
    try:
        res = json.loads(Path(path).read_text())
        if all(isinstance(r, dict) and {"concurrency", "output_throughput", "ttft_ms", "tpot_ms"} <= r.keys()
               for r in res["runs"]):
            return res
    except (ValueError, KeyError, TypeError):  # not JSON, or JSON of another shape
        pass
    raise ValueError(f"{path}: not a `bench serve` result (a JSON with runs of concurrency, throughput, TTFT, TPOT)")


def plot(paths: list[str], out: str, labels: list[str] | None = None) -> str:
    plt = _pyplot()
    fig, (thr, ttft, tpot) = plt.subplots(1, 3, figsize=(14, 4))
    for i, p in enumerate(paths):
        res = load_result(p)
        runs = sorted(res["runs"], key=lambda r: r["concurrency"])
        label = _label(res, p, labels, i)
        conc = [r["concurrency"] for r in runs]
        thr.plot(conc, [r["output_throughput"] or 0 for r in runs], marker="o", label=label)
        ttft.plot(conc, [_ms(r["ttft_ms"]["median"]) for r in runs], marker="o", label=label)
        tpot.plot(conc, [_ms(r["tpot_ms"]["p99"]) for r in runs], marker="o", label=label)
    for ax, title, ylabel in ((thr, "output throughput", "tokens/s"), (ttft, "median time to first token", "ms"),
                              (tpot, "p99 TPOT", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, out)


def ttft_cdf(paths: list[str], out: str, labels: list[str] | None = None) -> str:
    """Each file's requests (its first run's), their time to first token sorted: the share of
    requests (y) that had their first token within x ms; the median where a line crosses 0.5."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, p in enumerate(paths):
        res = load_result(p)
        records = res["runs"][0].get("records")
        if not records:
            raise ValueError(f"{p}: no per-request records (run `bench serve` with --save-records)")
        ttft = sorted(r["ttft"] * 1e3 for r in records if r.get("ttft") is not None)
        ax.step(ttft, [(k + 1) / len(ttft) for k in range(len(ttft))], where="post", label=_label(res, p, labels, i))
    ax.set_xscale("log")
    ax.set_xlabel("time to first token, ms (log)")
    ax.set_ylabel("share of requests")
    ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(plt, fig, out)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _label(res: dict, path: str, labels: list[str] | None, i: int) -> str:
    """The i-th of `labels` if given, else the run's own label, else the file's name."""
    return labels[i] if labels and i < len(labels) else res.get("label") or Path(path).stem


def _save(plt, fig, out: str) -> str:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ms(value) -> float:
    return float("nan") if value is None else value
