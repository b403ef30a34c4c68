"""The layering rules (README, "Architecture"), read from the source: who may import whom.

Every `import` and `from ... import` in the product's folders is parsed (function-level imports
included: lazy imports are imports too) and checked against the rules below.  A deliberately
broken file is checked the same way, so the test can fail.  Then a real `pip install` of the
project into a fresh virtualenv proves that nothing but `quantserve` lands at the top level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.support import REPO

# folder -> the module prefix it installs as (pyproject.toml's package-dir)
FOLDERS = {"quantserve": "quantserve", "server": "quantserve.server", "quant": "quantserve.quant",
           "training": "quantserve.training", "bench": "quantserve.bench"}

GROUND = ("quantserve.settings", "quantserve.formats", "quantserve.capabilities", "quantserve.modeling",
          "quantserve.plots", "quantserve.quiet", "quantserve.progress", "quantserve.bytecode_cache")
# a name with * is a pattern: a new endpoint's serving_<name>.py or a new <name>_engine.py backend
# lands in its layer without an edit here
HTTP = ("quantserve.server.api_server", "quantserve.server.serving*", "quantserve.server.protocol*",
        "quantserve.server.errors",
        "quantserve.server.middleware", "quantserve.server.metrics", "quantserve.server.unsupported",
        "quantserve.server.tools", "quantserve.server.tool_parsers", "quantserve.server.uvicorn_server",
        "quantserve.server.tokenizing")
ENGINE = ("quantserve.server.engine", "quantserve.server.engines", "quantserve.server.scheduler",
          "quantserve.server.exceptions", "quantserve.server.faults", "quantserve.server.sampling",
          "quantserve.server.paged_scheduler", "quantserve.server.running",
          "quantserve.server.textstream", "quantserve.server.config", "quantserve.server.structured",
          "quantserve.server.prefix_cache", "quantserve.server.backend", "quantserve.server.*_engine",
          "quantserve.server.fastcore")
BACKENDS = ("quantserve.server.backend", "quantserve.server.*_engine", "quantserve.server.fastcore",
            "quantserve.server.prefix_cache")
# above the HTTP layer: copies of the app placed by Ray Serve, and the gateway in front, started by the CLI
SCALE_OUT = ("quantserve.server.replicas", "quantserve.server.replica_server", "quantserve.server.gateway")
LIBRARY = ("quantserve.server", "quantserve.quant", "quantserve.training")
CLI_ONLY = ("quantserve.cli", "quantserve.cli_util", "quantserve.pipeline*", "quantserve.support",
            "quantserve.server.cli", "quantserve.quant.cli", "quantserve.training.cli", "quantserve.bench")
DEMO = ("quantserve.demo",)


def under(name: str, prefixes) -> bool:
    return any(fnmatch(name, p) if "*" in p else name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                pkg = module.split(".")[: len(module.split(".")) - node.level + (1 if module.endswith("__init__") else 0)]
                base = ".".join(pkg + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def violations(module: str, source: str) -> list[str]:
    bad = []
    for target, names in imports(source, module):
        top = target.split(".")[0]
        if top in ("server", "quant", "training", "bench"):
            bad.append(f"{module} imports bare '{target}' (use quantserve.{target})")
        if under(module, GROUND) and target.startswith("quantserve") and not under(target, GROUND):
            bad.append(f"ground {module} imports {target}")
        if under(module, ENGINE) and (under(target, HTTP) or under(target, CLI_ONLY) or under(target, SCALE_OUT)):
            bad.append(f"engine {module} imports the HTTP/CLI layer {target}")
        if under(module, ENGINE) and target == "quantserve.settings" and "UserError" in names:
            bad.append(f"engine {module} raises the CLI's UserError (raise a server.exceptions kind)")
        if under(module, BACKENDS) and under(target, ("quantserve.server.engines", "quantserve.server.scheduler")):
            bad.append(f"backend {module} imports the engine {target}")
        if under(module, HTTP) and (under(target, CLI_ONLY) or under(target, SCALE_OUT)):
            bad.append(f"HTTP {module} imports {target} from above it")
        if under(module, ("quantserve.quant", "quantserve.training")) and under(target, ("quantserve.server",)):
            bad.append(f"library {module} imports the server {target}")
        if under(module, LIBRARY) and not under(module, CLI_ONLY) and under(target, CLI_ONLY):
            bad.append(f"library {module} imports the CLI {target}")
        if under(module, LIBRARY) and under(target, ("quantserve.demo",)):
            bad.append(f"{module} imports the demo {target} (resolve names through quantserve.settings)")
    return bad


def product_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_every_module_has_a_layer():
    """A new module is placed in a layer here, so the rules above cover it."""
    layers = GROUND + HTTP + ENGINE + SCALE_OUT + CLI_ONLY + DEMO + ("quantserve.quant", "quantserve.training")
    loose = [m for m in map(module_name, product_files()) if m != "quantserve" and m != "quantserve.__main__"
             and m != "quantserve.server" and not under(m, layers)]
    assert not loose, f"modules in no layer of tests/unit/test_architecture.py: {loose}"


def test_every_import_follows_the_layering_rules():
    files = product_files()
    assert len(files) > 60
    bad = [v for f in files for v in violations(module_name(f), f.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module, source, needle", [
    ("quantserve.settings", "from quantserve.server.engine import EngineError", "ground"),
    ("quantserve.server.scheduler", "def f():\n    from quantserve.server.errors import APIError", "HTTP/CLI"),
    ("quantserve.server.hf_engine", "from quantserve.settings import UserError", "UserError"),
    ("quantserve.server.gguf_engine", "from quantserve.server.scheduler import Scheduler", "backend"),
    ("quantserve.training.train", "from quantserve.demo.default_model import resolve_model", "demo"),
    ("quantserve.quant.convert", "from server.engine import EngineError", "bare"),
    ("quantserve.formats", "def f():\n    import quantserve.quant.bnb", "ground"),
    ("quantserve.server.serving", "from quantserve.server.replicas import serve_replicas", "HTTP"),
    ("quantserve.quant.evaluate", "from quantserve.server.engines import ScheduledEngine", "server"),
    ("quantserve.training.train", "from quantserve.training.cli import app", "CLI"),
])
def test_a_broken_import_is_caught(module, source, needle):
    found = violations(module, source)
    assert found and needle in found[0], found


@pytest.mark.slow
def test_a_real_install_puts_only_quantserve_on_the_path(tmp_path):
    """`pip install .` (not editable) into a new virtualenv that sees this one's packages (torch,
    typer, setuptools ...) through a .pth line, and nothing of the repository."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # a path line only: the .pth files over there (our editable install's finder) are not run
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # the new venv's bundled setuptools is older than the one this project builds with
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], capture_output=True)
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    top = sorted(p.name for p in Path(site).iterdir() if not p.name.endswith((".dist-info", ".pth"))
                 and p.name not in ("pip", "setuptools", "_distutils_hack", "pkg_resources", "__pycache__"))
    assert "quantserve" in top
    assert not {"server", "quant", "training", "bench", "tests"} & set(top), top
    # outside the repo, where no folder of it is on sys.path: the namespace imports, bare names do not
    probe = ("import importlib.util, quantserve.server.engine, quantserve.quant.cli, quantserve.training.config, "
             "quantserve.bench.args, quantserve.demo; from quantserve.demo.default_model import shipped_model; "
             "assert shipped_model() is not None, 'the default model is not in the wheel'; "
             "from quantserve.server.fastcore.kernel_tables import TABLES; "
             "print(sorted(p.name for p in TABLES.glob('*.json'))); "
             "print([m for m in ('server', 'quant', 'training', 'bench') if importlib.util.find_spec(m)])")
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tables, bare = out.stdout.strip().splitlines()
    assert bare == "[]"
    # the weight-kernel tables shipped per GPU model are package data: in the wheel, every one
    assert tables == str(sorted(p.name for p in (REPO / "server/fastcore/kernel_tables").glob("*.json")))
    help_ = subprocess.run([str(venv / "bin" / "quantserve"), "--help"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=120)
    assert help_.returncode == 0 and "serve" in help_.stdout


def test_tests_share_code_through_the_support_package_only():
    """No test imports conftest or another test module by a bare name: what tests share lives in
    tests/support/ and is imported as tests.support.<module>."""
    bare = {p.stem for p in (REPO / "tests").rglob("*.py")} | {"conftest", "support"}
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for target, _ in imports(path.read_text(), "tests.x"):
            top = target.split(".")[0]
            if top in bare or (top == "tests" and target.split(".")[1:2] not in (["support"], [])):
                bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, "\n".join(bad)
