"""What `--replicas 1` costs against a bare server: one markdown table from `bench serve` results.

    python -m bench.replicas_compare OUT_DIR      # reads OUT_DIR/{bare,ray,direct}-N.json

`bench/replicas_overhead.sh` writes those files: the servers benchmarked in turn, round N of each
one right after the other, so a round's runs saw the same machine.  `ray` is `--replicas 1`
through its gateway (what clients use); `direct`, where present, is the same replica's own port,
which tells the gateway's hop apart from the replica's life inside Ray.  Per concurrency the
table gives every round's output tokens/s and mean time to first token, and the median over
rounds of each round's ratio to the bare server, against issue 22's targets for `ray`: at most
5 % more time to first token, at most 3 % less throughput.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

TTFT_LIMIT = 1.05  # replicas' TTFT / bare's, at most
THROUGHPUT_LIMIT = 0.97  # replicas' output tokens/s / bare's, at least
SERIES = {"ray": "`--replicas 1`", "direct": "its replica's own port"}


def load(folder: Path) -> dict[str, dict[int, dict[int, dict]]]:
    """{series: {round: {concurrency: the run's figures}}}, the rounds every series has."""
    found: dict[str, dict[int, dict[int, dict]]] = {}
    for path in sorted(folder.glob("*.json")):
        m = re.fullmatch(r"(bare|ray|direct)-(\d+)\.json", path.name)
        if not m:
            continue
        try:
            runs = json.loads(path.read_text())["runs"]
            found.setdefault(m[1], {})[int(m[2])] = {r["concurrency"]: r for r in runs}
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {path} is not a `bench serve` result ({type(e).__name__}: {e})") from None
    if "bare" not in found or "ray" not in found:
        raise SystemExit(f"error: no bare-N.json and ray-N.json in {folder}: run bench/replicas_overhead.sh first")
    rounds = sorted(set.intersection(*(set(runs) for runs in found.values())))
    if not rounds:
        raise SystemExit(f"error: no round that every series has in {folder}")
    return {series: {n: runs[n] for n in rounds} for series, runs in found.items()}


def _fmt(values: list[float], digits: int) -> str:
    return " / ".join(f"{v:,.{digits}f}" for v in values)


def table(folder: Path) -> str:
    data = load(folder)
    rounds = sorted(data["bare"])
    levels = sorted(set.intersection(*(set(data[s][n]) for s in data for n in rounds)))
    lines = [f"{len(rounds)} rounds; a ratio is the median over rounds of (server / bare) in the same round", "",
             "| conc. | server | out tok/s | ratio | TTFT mean ms | ratio | TTFT diff ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    verdicts = []
    for c in levels:
        tput = {s: [data[s][n][c]["output_throughput"] for n in rounds] for s in data}
        ttft = {s: [data[s][n][c]["ttft_ms"]["mean"] for n in rounds] for s in data}
        lines.append(f"| {c} | bare | {_fmt(tput['bare'], 1)} | 1 | {_fmt(ttft['bare'], 2)} | 1 | |")
        for series in (s for s in SERIES if s in data):
            t_ratio = statistics.median(x / b for x, b in zip(tput[series], tput["bare"]))
            f_ratio = statistics.median(x / b for x, b in zip(ttft[series], ttft["bare"]))
            diff = statistics.median(x - b for x, b in zip(ttft[series], ttft["bare"]))
            lines.append(f"| {c} | {SERIES[series]} | {_fmt(tput[series], 1)} | **{t_ratio:.3f}×** | "
                         f"{_fmt(ttft[series], 2)} | **{f_ratio:.3f}×** | {diff:+.2f} |")
            if series == "ray":
                failed = sum(data[s][n][c]["failed"] for s in data for n in rounds)
                verdicts.append(f"concurrency {c}: throughput ≥ {THROUGHPUT_LIMIT}× "
                                f"{'met' if t_ratio >= THROUGHPUT_LIMIT else 'NOT met'}, TTFT ≤ {TTFT_LIMIT}× "
                                f"{'met' if f_ratio <= TTFT_LIMIT else 'NOT met'}"
                                + (f"; {failed} requests failed" if failed else ""))
    return "\n".join(lines + [""] + verdicts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the OUT_DIR of bench/replicas_overhead.sh")
    args = ap.parse_args(argv)
    print(table(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
