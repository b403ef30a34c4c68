"""Write the weight-kernel table shipped for a GPU model (server/fastcore/kernel_tables.py) from the
choices its runs tuned: the `weight-kernels.json` of each run's compile cache, one per model shape.

    python -m quantserve.bench.kernel_table --gpu "NVIDIA H100 80GB HBM3" \\
        /tmp/qs-home-8b/compile/*/weight-kernels.json /tmp/qs-home-1b/compile/*/weight-kernels.json

The table lands in `--out` (default: the package's own kernel_tables folder) as `<gpu key>.json`;
rows already in a table there are kept unless a file given here names the same shape (the files'
rows win: they are the newer tuning).  Run it where the runs ran: it records the torch and Triton
versions it finds there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantserve.server.fastcore.kernel_tables import TABLES, merge_rows, read_rows, table_key, write_table


def _versions() -> dict:
    out = {}
    for name in ("torch", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="weight-kernels.json files of a GPU's compile caches")
    ap.add_argument("--gpu", required=True, help="the GPU's name as torch reports it (torch.cuda.get_device_name())")
    ap.add_argument("--out", type=Path, default=TABLES, help="the folder of tables (default: the package's)")
    args = ap.parse_args(argv)
    lists = []
    for f in args.files:
        rows = read_rows(f)
        if not rows:
            raise SystemExit(f"{f}: no kernel choices in it (missing, unreadable or empty)")
        lists.append(rows)
    path = args.out / f"{table_key(args.gpu)}.json"
    rows = merge_rows(*lists, read_rows(path))
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(path, args.gpu, rows, _versions())
    print(f"{path}: {len(rows)} choices for {args.gpu} (from {len(args.files)} file(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
