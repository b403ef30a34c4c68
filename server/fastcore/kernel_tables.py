"""Tuned weight-kernel choices shipped per GPU model, so a first start on a known GPU times nothing.

A start with nothing cached tunes the Triton weight kernels for every layer shape and forward
size: every config of every candidate compiled, then timed (triton_mm._launch).  On an H100 that
was ~28 s of a 73 s cold start of the 8B shape (bench/RESULTS.md, 2026-12-05 night: waiting for
the configs' compiles 14.7 s, timing them 12.9 s).  The choices it makes depend on the GPU model
and the shapes, not on the weights, so the project ships what its own GPU runs chose, one JSON
file per GPU model in `kernel_tables/` (vLLM ships its fused-MoE kernels' configs the same way):
a first start on that GPU compiles one config per shape and times none.

    kernel_tables/<gpu key>.json   {"gpu": ..., "made_with": {...}, "rows": [triton_mm.save_choices rows]}

Where both exist, the choices tuned on this machine (the compile cache's `weight-kernels.json`)
win over the shipped ones.  A GPU with no table tunes as before.  `QUANTSERVE_KERNEL_TABLES=0`
ignores the shipped tables (the next start then tunes on this machine).  `bench/kernel_table.py`
writes a table from the compile caches of a GPU's runs.

Pure Python: no torch or Triton here (the CPU tests read the tables).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TABLES = Path(__file__).parent / "kernel_tables"


def table_key(gpu_name: str) -> str:
    """A GPU's name as a file name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3".  The whole
    name, not the chip: an H100 PCIe (114 multiprocessors, 2 TB/s) tunes differently from an SXM one
    (132, 3.35 TB/s), and an H200 (the SXM chip, 4.8 TB/s) from both."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-")


def shipped_table(gpu_name: str | None) -> Path | None:
    """The shipped table for this GPU model, or None (no such file, no GPU name, or the tables
    turned off by QUANTSERVE_KERNEL_TABLES=0)."""
    if not gpu_name or os.environ.get("QUANTSERVE_KERNEL_TABLES", "1") == "0":
        return None
    path = TABLES / f"{table_key(gpu_name)}.json"
    return path if path.is_file() else None


def read_rows(path: Path) -> list[dict]:
    """The choice rows of a table or of a compile cache's `weight-kernels.json` (a bare list); []
    for a missing or unreadable file (the shapes are then tuned, as with no file)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else data
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def merge_rows(*row_lists: list[dict]) -> list[dict]:
    """One row per key (kernel name, M bucket, batch 1, N, K, dtype, group), the first list's row
    winning; sorted by key so a table's diff shows what changed."""
    merged: dict[str, dict] = {}
    for rows in row_lists:
        for row in rows:
            merged.setdefault(json.dumps(row.get("key")), row)
    return [merged[k] for k in sorted(merged)]


def write_json(path: Path, data, indent: int | None = None) -> None:
    """`data` as JSON at `path`, whole or not at all: a process killed mid-write leaves the old file."""
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    tmp.replace(path)


def write_table(path: Path, gpu_name: str, rows: list[dict], made_with: dict) -> None:
    """A shipped table at `path` (indented: its diff in a commit shows what changed)."""
    write_json(path, {"gpu": gpu_name, "made_with": made_with, "rows": rows}, indent=1)
