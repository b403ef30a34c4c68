"""Shared by the reliability tests (test_soak.py, test_faults.py, test_server_faults.py and the replica tests in
tests/serve/): the size they run at, and the figures each suite writes to
runs/reliability/<suite>.json.

QUANTSERVE_RELIABILITY=quick (default, CI) or full (64 clients x 120 s, more kill points)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support import REPO
SIZE = os.environ.get("QUANTSERVE_RELIABILITY", "quick").strip().lower()
if SIZE not in ("quick", "full"):
    raise ValueError(f"QUANTSERVE_RELIABILITY={SIZE!r}: use quick or full")
FULL = SIZE == "full"


class Figures:
    """Rows of {"what", "figure"}; `write()` saves them (tests call it in a fixture's teardown, so
    the figures of the tests that ran are kept even when one fails)."""

    def __init__(self, suite: str):
        self.suite, self.rows = suite, []

    def add(self, what: str, figure) -> None:
        self.rows.append({"what": what, "figure": str(figure)})

    def write(self) -> Path:
        out = REPO / "runs" / "reliability" / f"{self.suite}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"suite": self.suite, "size": SIZE, "rows": self.rows}, indent=1) + "\n")
        return out
