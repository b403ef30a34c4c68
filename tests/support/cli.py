"""Running the `quantserve` command line as a user would, and checking its one-line errors."""

import os
import subprocess
import sys

from tests.support import REPO


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "quantserve", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_error(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
