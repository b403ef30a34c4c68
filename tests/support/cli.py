"""Running the `quantserve` command line as a user would, and checking its one-line errors."""

import os
import subprocess
import sys

import pytest

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


def ctrl_c(*args, after: str, stream: str = "stdout", timeout: float = 120) -> tuple[int, str, str]:
    """Run `quantserve ARGS` in a session of its own, and once a line of its `stream` holds `after`
    press Ctrl-C as a terminal does: SIGINT to its whole process group (the children it started
    too).  Returns its exit code, its stdout and its stderr, each with the lines read before the
    signal.  Still running `timeout` seconds later: fails with where each of its threads was.

    The command starts with SIGINT's default action, as from a shell: pytest-xdist's workers ignore
    SIGINT, a process inherits that, and Python then installs no KeyboardInterrupt at all (`make
    test` found the commands still running 120 s after the signal)."""
    import shutil
    import signal

    import pytest

    proc = subprocess.Popen([sys.executable, "-m", "quantserve", *args], cwd=REPO, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = []
    try:
        for line in getattr(proc, stream):
            seen.append(line)
            if after in line:
                break
        if proc.poll() is not None:
            pytest.fail(f"it ended before {after!r}: {''.join(seen)}")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
            stacks = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True).stdout \
                if os.path.exists(spy) else "(no py-spy to show where)"
            pytest.fail(f"still running {timeout:.0f} s after Ctrl-C; its threads:\n{stacks}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    read = "".join(seen)
    return proc.returncode, (read + out if stream == "stdout" else out), (read + err if stream == "stderr" else err)


def quant_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run `quant ARGS` in-process through the real entry point (one-line errors, exit codes):
    (exit code, stdout, stderr)."""
    from quantserve.quant.cli import main

    monkeypatch.setattr(sys, "argv", ["quant", *args])
    with pytest.raises(SystemExit) as exc:
        main()
        raise SystemExit(0)
    cap = capsys.readouterr()
    return exc.value.code or 0, cap.out, cap.err
