"""Compiled Python bytecode for the libraries a server imports, kept where later starts find it.

A server's start imports torch's compiler stack (dynamo, inductor, sympy), transformers and triton:
thousands of modules.  Python reads each one's compiled bytecode from the `__pycache__` folder
beside it, or compiles the source and writes that folder.  Where neither can happen — packages
installed without bytecode (`pip install --no-compile`, many images) into a folder the server
cannot write, or `PYTHONDONTWRITEBYTECODE=1`, which many Dockerfiles set — every start compiles
every module again: 10.3 s of a 26 s warm start of the 8B shape on an H100 machine whose image was
built that way (bench/RESULTS.md, 2026-12-05, "where a start's time goes").

`use_bytecode_cache()` then points Python at a mirror tree under the cache folder
(`sys.pycache_prefix`, Python's own switch, the `PYTHONPYCACHEPREFIX` variable's), writable, so
only the first start compiles.  It changes nothing where the libraries already have their bytecode
or the user chose a prefix; `QUANTSERVE_BYTECODE_CACHE=0` turns it off.  The environment carries
the choice to the processes a server starts (inductor's compile workers, Ray's replicas).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from quantserve.settings import cache_dir

PROBE = "torch"  # the largest import of a start: where its bytecode is, the others' is too


def bytecode_missing(package: str = PROBE) -> bool:
    """True when `package` is installed and Python has no compiled bytecode for its `__init__`
    (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    return not Path(importlib.util.cache_from_source(spec.origin)).is_file()


def use_bytecode_cache(package: str = PROBE) -> Path | None:
    """Keep compiled bytecode under the cache folder when `package` has none of its own; returns the
    folder used, or None where nothing changed."""
    if os.environ.get("QUANTSERVE_BYTECODE_CACHE", "1") == "0" or sys.pycache_prefix is not None:
        return None
    if not bytecode_missing(package):
        return None
    folder = cache_dir() / "bytecode" / f"py{sys.version_info.major}{sys.version_info.minor}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable cache folder: start as before
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return folder
