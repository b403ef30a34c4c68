"""The reliability figures as one markdown table, from the JSON the reliability tests write.

    python -m bench.reliability_table            # reads runs/reliability/*.json

`make reliability` runs the suites at full size and then prints this table; the README's table
is a copy of its output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SUITES = ("fuzz", "hostile", "security", "soak", "faults", "server-faults", "replicas", "replicas-autoscale")


def table(folder: Path) -> str:
    lines = ["| suite | size | what | figure |", "|---|---|---|---|"]
    found = 0
    for suite in SUITES:
        path = folder / f"{suite}.json"
        if not path.is_file():
            continue
        found += 1
        data = json.loads(path.read_text())
        for row in data["rows"]:
            figure = row["figure"].replace("|", "\\|")
            lines.append(f"| {suite} | {data['size']} | {row['what']} | {figure} |")
    if not found:
        raise SystemExit(f"error: no figures in {folder}: run `make reliability` (or the reliability tests) first")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path, default=Path("runs/reliability"))
    args = ap.parse_args(argv)
    print(table(args.folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
