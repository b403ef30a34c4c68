"""quantserve/bytecode_cache.py: where the libraries have no compiled bytecode and Python may not
write it beside them, the bytecode goes to a mirror tree under the cache folder, so only the first
start compiles them.  Real interpreters, a real package without bytecode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = """
import sys
from quantserve.bytecode_cache import use_bytecode_cache
print(use_bytecode_cache("probe_pkg"))
import probe_pkg
print(probe_pkg.VALUE, sys.dont_write_bytecode)
"""


@pytest.fixture
def library(tmp_path) -> Path:
    """A package with a submodule and no bytecode, as `pip install --no-compile` leaves one."""
    pkg = tmp_path / "lib" / "probe_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from probe_pkg.sub import VALUE\n")
    (pkg / "sub.py").write_text("VALUE = 42\n")
    return tmp_path / "lib"


def start(library: Path, home: Path, **env) -> list[str]:
    environ = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "QUANTSERVE_HOME": str(home),
               "PYTHONPATH": os.pathsep.join([str(library), *sys.path]), **env}
    environ.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=environ, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_a_library_without_bytecode_gets_it_under_the_cache_folder(library, tmp_path):
    home = tmp_path / "home"
    folder, imported = start(library, home)[:2]
    assert Path(folder).is_relative_to(home) and imported == "42 False"
    cached = sorted(p.name for p in Path(folder).rglob("*.pyc"))
    assert any(name.startswith("sub.") for name in cached) and any(name.startswith("__init__.") for name in cached)
    assert not list(library.rglob("__pycache__"))  # the library's own folder is left as it was
    # the next start finds it: its bytecode files are read, not written again
    before = {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*.pyc")}
    assert start(library, home)[:2] == [folder, "42 False"]
    assert {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*.pyc")} == before


def test_nothing_changes_where_the_library_has_bytecode_or_the_user_says_no(library, tmp_path):
    home = tmp_path / "home"
    assert start(library, home, QUANTSERVE_BYTECODE_CACHE="0")[:2] == ["None", "42 True"]
    assert not (home / "bytecode").exists()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(library)], check=True)
    assert start(library, home)[:2] == ["None", "42 True"]
    assert not (home / "bytecode").exists()
