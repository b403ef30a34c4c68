"""The training benchmark's report: one `Result` per row, the table, the summary against the
issue's targets, and the plot (bench/train_bench.py measures; this file only presents)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Result:
    row: str
    status: str = "ok"  # ok | skipped | failed | oom
    tokens_per_s: float | None = None
    step_s: float | None = None
    peak_gib: float | None = None
    plan_gib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def plan_error(self) -> float | None:
        if self.peak_gib and self.plan_gib:
            return self.plan_gib / self.peak_gib - 1
        return None


def print_table(results: list[Result], base: Result | None) -> None:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    print(f"\n{'row':34} {'status':8} {'tok/s':>10} {'x plain':>8} {'s/step':>8} {'peak GiB':>9} "
          f"{'% plain':>8} {'plan GiB':>9} {'plan err':>9}  note")
    for r in results:
        speed = r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s and r.tokens_per_s else None
        mem = r.peak_gib / base.peak_gib * 100 if base and base.peak_gib and r.peak_gib else None
        err = f"{r.plan_error * 100:+.0f}%" if r.plan_error is not None else "-"
        print(f"{r.row:34} {r.status:8} {f(r.tokens_per_s, ',.0f'):>10} {f(speed, '.2f'):>8} {f(r.step_s, '.3f'):>8} "
              f"{f(r.peak_gib, '.2f'):>9} {f(mem, '.0f'):>8} {f(r.plan_gib, '.2f'):>9} {err:>9}  {r.note}")


def plot(results: list[dict], out: Path) -> Path:
    """Two panels per row: tokens/s, and measured peak memory with plan's prediction as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.get("status") == "ok"]
    names = [r["row"] for r in rows][::-1]
    rows = rows[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    ax1.barh(names, [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax1.set_xlabel("tokens/s")
    nan = float("nan")  # no peak on a CPU (--quick)
    ax2.barh(names, [r["peak_gib"] or nan for r in rows], color="tab:orange", label="measured peak")
    ax2.scatter([r["plan_gib"] or nan for r in rows], names, marker="|", s=300, color="black", label="plan")
    ax2.set_xlabel("GiB")
    ax2.legend(loc="lower right")
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summarize(results: list[Result], base: Result | None) -> dict:
    """The figures the training targets are stated in: Liger + checkpointing against plain HF,
    offload's step-time cost, the memory plan's worst error, QLoRA's longest fitting context."""
    summary: dict = {}
    both = next((r for r in results if r.row == "1B + Liger + checkpointing" and r.status == "ok"), None)
    if base and both and base.peak_gib:
        summary["liger_ckpt_speedup"] = both.tokens_per_s / base.tokens_per_s
        summary["liger_ckpt_memory_fraction"] = both.peak_gib / base.peak_gib
        summary["target_met"] = summary["liger_ckpt_speedup"] >= 1.25 and summary["liger_ckpt_memory_fraction"] <= 0.40
    z = {r.row: r for r in results if r.row.startswith("ZeRO-2") and r.status == "ok"}
    if len(z) == 2:
        summary["offload_step_time_ratio"] = z["ZeRO-2 + optimizer offload"].step_s / z["ZeRO-2"].step_s
    errs = [abs(r.plan_error) for r in results if r.plan_error is not None]
    if errs:
        summary["plan_max_abs_error"] = max(errs)
        summary["plan_within_20pct"] = max(errs) <= 0.20
    q = [r for r in results if "QLoRA" in r.row]
    if q:
        summary["qlora_longest_fitting_context"] = q[-1].extra.get("longest_fitting_context")
    return summary
