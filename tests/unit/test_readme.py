"""The README's code blocks, run as a reader would paste them (extracted here, so they cannot drift).

A block is run when the line before its opening fence is a marker:
- `<!-- readme-test: cpu -->`: each line of a bash block is a command, run in a fresh folder with
  the virtualenv's bin on PATH (as the README says to activate it); it must exit 0.
- `<!-- readme-test: served -->`: the block (bash or python) is sent to a `quantserve serve
  default` that the test starts on port 8000 (or another free port, put in the text in its place).
A `# prints: TEXT` comment on a line means its output must contain TEXT.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.servers import ServerProcess

MARKER = re.compile(r"<!-- readme-test: (cpu|served) -->\n```(bash|python)\n(.*?)```", re.S)
PRINTS = re.compile(r"#\s*prints:\s*(.+)$")


def blocks(kind: str) -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    return [(lang, body) for k, lang, body in MARKER.findall(text) if k == kind]


def env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "VIRTUAL_ENV": str(Path(bin_dir).parent)}


def expected(line: str) -> str | None:
    m = PRINTS.search(line)
    return m.group(1).strip() if m else None


def commands(body: str) -> list[str]:
    return [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_has_runnable_blocks():
    assert len(blocks("cpu")) >= 1 and len(blocks("served")) >= 2


@pytest.mark.parametrize("body", [b for _, b in blocks("cpu")])
def test_cpu_block_runs_as_pasted(body, tmp_path):
    for line in commands(body):
        proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env(), capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (line, proc.stdout[-1500:], proc.stderr[-1500:])
        want = expected(line)
        if want:
            assert want in proc.stdout, (line, proc.stdout)


@pytest.fixture(scope="module")
def default_server(default_model):
    srv = ServerProcess("default")
    yield srv
    srv.stop()


@pytest.mark.parametrize("lang, body", blocks("served"))
def test_served_block_works_as_pasted(lang, body, default_server, tmp_path):
    text = body.replace("8000", str(default_server.port))
    if lang == "python":
        runs = [[sys.executable, "-c", text]]
        wants = [w for w in map(expected, body.splitlines()) if w]
    else:
        runs = [["bash", "-c", line] for line in commands(text)]
        wants = [expected(line) for line in commands(body)]
    for i, cmd in enumerate(runs):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (cmd[-1], proc.stdout[-1500:], proc.stderr[-1500:])
        for want in (wants if lang == "python" else [wants[i]]):
            if want:
                assert want in proc.stdout, (cmd[-1], proc.stdout)


def test_the_readme_torch_line_reaches_pip_as_separate_arguments(tmp_path):
    """The README's install line for the public index (a CPU torch from PyTorch's own index) is a
    spec plus pip options: `make` must pass them to pip as separate words (quoted as one, pip
    refused it as an invalid requirement)."""
    import shlex

    line = re.search(r'make\s+TORCH_SPEC="([^"]+)"', (REPO / "README.md").read_text().replace("\n", " "))
    assert line, "the README no longer shows the public-index torch line"
    dry = subprocess.run(["make", "-n", "-B", "install", f"TORCH_SPEC={line.group(1)}", f"VENV={tmp_path / 'v'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    # the install recipe's pip calls: upgrade pip, then torch alone, then the project
    pip_calls = [shlex.split(cmd.strip().rstrip("\\").strip()) for cmd in dry.stdout.split("&&") if "pip install" in cmd]
    words = pip_calls[1]
    assert words[words.index("-q") + 1:] == shlex.split(line.group(1)), words
