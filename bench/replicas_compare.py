"""What `--replicas 1` costs against a bare server: one markdown table from `bench serve` results.

    python -m bench.replicas_compare OUT_DIR      # reads OUT_DIR/bare-N.json and OUT_DIR/ray-N.json

`bench/replicas_overhead.sh` writes those files: the two servers benchmarked in turn, round N of
each one right after the other, so a round's two runs saw the same machine.  Per concurrency the
table gives every round's output tokens/s and mean time to first token, and the median over
rounds of each round's ratio (replicas / bare), against issue 22's targets: at most 5 % more time
to first token, at most 3 % less throughput.
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


def load(folder: Path) -> dict[str, dict[int, dict[int, dict]]]:
    """{"bare"|"ray": {round: {concurrency: the run's figures}}}."""
    found: dict[str, dict[int, dict[int, dict]]] = {"bare": {}, "ray": {}}
    for path in sorted(folder.glob("*.json")):
        m = re.fullmatch(r"(bare|ray)-(\d+)\.json", path.name)
        if not m:
            continue
        try:
            runs = json.loads(path.read_text())["runs"]
            found[m[1]][int(m[2])] = {r["concurrency"]: r for r in runs}
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: {path} is not a `bench serve` result ({type(e).__name__}: {e})") from None
    rounds = sorted(set(found["bare"]) & set(found["ray"]))
    if not rounds:
        raise SystemExit(f"error: no round with both bare-N.json and ray-N.json in {folder}: "
                         "run bench/replicas_overhead.sh first")
    return {kind: {n: found[kind][n] for n in rounds} for kind in found}


def _fmt(values: list[float], digits: int) -> str:
    return " / ".join(f"{v:,.{digits}f}" for v in values)


def table(folder: Path) -> str:
    data = load(folder)
    rounds = sorted(data["bare"])
    levels = sorted(set.intersection(*(set(data[k][n]) for k in data for n in rounds)))
    lines = [f"{len(rounds)} rounds; ratios are the median over rounds of replicas / bare in the same round", "",
             "| conc. | bare out tok/s | `--replicas 1` out tok/s | ratio (≥ 0.97) | bare TTFT ms | "
             "`--replicas 1` TTFT ms | ratio (≤ 1.05) | TTFT diff ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for c in levels:
        tput = {k: [data[k][n][c]["output_throughput"] for n in rounds] for k in data}
        ttft = {k: [data[k][n][c]["ttft_ms"]["mean"] for n in rounds] for k in data}
        failed = sum(data[k][n][c]["failed"] for k in data for n in rounds)
        t_ratio = statistics.median(r / b for r, b in zip(tput["ray"], tput["bare"]))
        f_ratio = statistics.median(r / b for r, b in zip(ttft["ray"], ttft["bare"]))
        diff = statistics.median(r - b for r, b in zip(ttft["ray"], ttft["bare"]))
        lines.append(f"| {c} | {_fmt(tput['bare'], 1)} | {_fmt(tput['ray'], 1)} | **{t_ratio:.3f}×** | "
                     f"{_fmt(ttft['bare'], 2)} | {_fmt(ttft['ray'], 2)} | **{f_ratio:.3f}×** | {diff:+.2f} |")
        verdicts.append(f"concurrency {c}: throughput {'met' if t_ratio >= THROUGHPUT_LIMIT else 'NOT met'}, "
                        f"TTFT {'met' if f_ratio <= TTFT_LIMIT else 'NOT met'}"
                        + (f", {failed} failed requests" if failed else ""))
    return "\n".join(lines + [""] + verdicts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="the OUT_DIR of bench/replicas_overhead.sh")
    args = ap.parse_args(argv)
    print(table(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
