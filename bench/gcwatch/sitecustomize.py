"""Imported by Python at start-up when this folder is on PYTHONPATH (bench/engine_v2.sh phase 18):
every collection of the oldest generation, and any collection over 5 ms, goes to stderr with its
length, so a stall in a server's log can be told apart from a collection."""

import gc
import sys
import time

_started = [0.0]


def _watch(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started[0]) * 1e3
    if info["generation"] == 2 or ms > 5:
        print(f"gcwatch: generation {info['generation']} took {ms:.1f} ms ({info['collected']} collected)",
              file=sys.stderr, flush=True)


gc.callbacks.append(_watch)
