"""Fault injection on files, for real: processes killed with SIGKILL while they write.  Each test
checks that nothing was lost and writes its figures to runs/reliability/faults.json
(tests/reliability/test_server_faults.py injects faults into a running server).

- `quant convert` killed at several points: never an output that looks valid but is not; a rerun
  succeeds and leaves nothing behind; a `--force` replacement killed anywhere keeps a whole output.
- training killed while it writes a checkpoint: the next run resumes from the one before (a kill
  between checkpoints is tests/train/test_train_runs.py::test_sigkill_then_resume_matches_an_uninterrupted_run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.figures import FULL, Figures

QUANT = str(Path(sys.executable).parent / "quant")


@pytest.fixture(scope="module")
def figures():
    f = Figures("faults")
    yield f
    f.write()


# ---- a. quant convert killed ------------------------------------------------------------------------

def output_state(out: Path) -> str:
    """"absent", "complete: FORMAT" (manifest, `quant inspect` passes, every listed file present and
    the sizes the manifest records), or what is wrong with it."""
    if not out.exists():
        return "absent"
    manifest = out / "manifest.json"
    if not manifest.is_file():
        return f"a folder without manifest: {sorted(p.name for p in out.iterdir())}"
    m = json.loads(manifest.read_text())
    missing = [f for f in m["files"] if not (out / f).is_file()]
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    if missing or size != m["size_bytes"]:
        return f"incomplete: missing {missing}, {size} bytes of {m['size_bytes']}"
    r = subprocess.run([QUANT, "inspect", str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`quant inspect` fails: {r.stderr.strip()}"
    return f"complete: {m['format']}"


def convert_cmd(src: Path, fmt: str, out: Path, *extra: str) -> list[str]:
    return [QUANT, "convert", str(src), "-f", fmt, "-o", str(out), "-q", *extra]


def run_and_kill(cmd: list[str], out: Path, delay: float) -> tuple[float, bool]:
    """Start `cmd`; SIGKILL it `delay` s after its hidden partial folder appears.  Returns (seconds
    the partial folder existed before the kill, whether the process had exited by itself first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not partial.exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no partial folder within 120 s"
        time.sleep(0.005)
    seen = time.monotonic()
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.monotonic() - seen, proc.returncode == 0  # 0: it had finished; -9: killed


def conversion_window(src: Path, fmt: str, out: Path) -> float:
    """Seconds an uninterrupted conversion spends after creating its partial folder."""
    proc = subprocess.Popen(convert_cmd(src, fmt, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    while not partial.exists() and proc.poll() is None:
        time.sleep(0.005)
    seen = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return time.monotonic() - seen


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def dead_pid() -> int:
    """The PID of a process that has exited (as a killed conversion's is)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


FRACTIONS = [0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0] if FULL else [0.0, 0.3, 0.6, 0.9]


@pytest.mark.parametrize("fmt, replacement", [("gguf-q4_k_m", "gguf-f16")]
                         + ([("bnb-nf4", "gguf-q8_0")] if FULL else []))
def test_killed_conversions_never_leave_a_valid_looking_partial_output(fmt, replacement, default_model, tmp_path,
                                                                       figures):
    window = conversion_window(default_model, fmt, tmp_path / "timing" / "out")
    root = tmp_path / "fresh"
    root.mkdir()
    out = root / "out"
    states = []
    # 1. a fresh target, killed at points spread over the conversion
    for f in FRACTIONS:
        lived, _ = run_and_kill(convert_cmd(default_model, fmt, out), out, f * window)
        state = output_state(out)
        states.append(state)
        # absent, or (killed after its final rename) whole: nothing in between
        assert state in ("absent", f"complete: {fmt}"), (f, lived, state)
        if state != "absent":
            shutil.rmtree(out)
    # 2. a rerun over the killed runs' debris succeeds and removes it
    r = subprocess.run(convert_cmd(default_model, fmt, out), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert output_state(out) == f"complete: {fmt}" and leftovers(root) == ["out"]
    # 3. `--force` over that output, killed anywhere: a whole output (old or new) is always there
    forced = []
    for f in FRACTIONS:
        run_and_kill(convert_cmd(default_model, replacement, out, "--force"), out, f * window)
        forced.append(output_state(out))
        assert forced[-1] in (f"complete: {fmt}", f"complete: {replacement}"), (f, forced[-1])
    # 4. the one instant with no output at all: killed between moving the old output aside and
    #    renaming the new one in (what that leaves, made by hand); the next run puts the old one back
    old_format = forced[-1].split(": ")[1]
    aside = root / f".out.old-{dead_pid()}"
    out.rename(aside)
    (root / f".out.partial-{dead_pid()}").mkdir()  # and the new one, finished but not renamed
    assert output_state(out) == "absent"
    r = subprocess.run(convert_cmd(default_model, replacement, out), capture_output=True, text=True)
    assert r.returncode == 1 and "already exists" in r.stderr, r.stderr
    assert output_state(out) == f"complete: {old_format}" and leftovers(root) == ["out"]
    kills = len(FRACTIONS) * 2
    figures.add(f"convert {fmt}: SIGKILL points (fresh target)",
                f"{len(FRACTIONS)} at {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the {window:.2f} s after "
                f"the partial folder appears; outputs after the kill: "
                f"{states.count('absent')} absent, {len(states) - states.count('absent')} complete, 0 invalid")
    figures.add(f"convert {fmt} --force {replacement} over a finished output: SIGKILL points",
                f"{len(FRACTIONS)}; a whole output every time ({forced.count(f'complete: {fmt}')} old, "
                f"{forced.count(f'complete: {replacement}')} new), 0 missing or invalid")
    figures.add(f"convert {fmt}: killed between the two renames of a --force replacement",
                "previous output restored by the next run; 0 bytes lost")
    figures.add(f"convert {fmt}: rerun after {kills} kills", "complete output, no leftover partial folders")


# ---- b. training killed ------------------------------------------------------------------------------

def test_training_killed_while_saving_a_checkpoint_resumes(default_model, tmp_path, figures):
    from quantserve.demo.corpus import task_examples, write_jsonl

    data = tmp_path / "task.jsonl"
    write_jsonl(data, task_examples(256, "train"))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "quantserve", "train", "--quiet", "--data", str(data), "--max-steps", "12",
           "--micro-batch", "8", "--save-steps", "4", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    saving = out / "checkpoint-8"
    deadline = time.monotonic() + 300
    while not saving.is_dir():  # kill the moment the Trainer starts writing checkpoint-8
        assert proc.poll() is None, "training ended before checkpoint-8 was written"
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    state = saving / "trainer_state.json"
    mid_save = not state.exists()
    if not mid_save:  # the kill came a moment late; a moment earlier the Trainer had not written this yet
        state.unlink()
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    assert not (out / "train_log.json").exists(), "the run finished before the kill"

    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["resumed_from"].endswith("checkpoint-4") and log["global_step"] == 12
    assert len([s for s in log["steps"] if "loss" in s]) == 12  # the log covers the whole run
    assert (out / "checkpoint-12" / "trainer_state.json").is_file()
    figures.add("training SIGKILLed while writing checkpoint-8",
                f"killed {'mid-save' if mid_save else 'just after the save (trainer_state.json removed)'}; "
                "the rerun skipped the incomplete checkpoint, resumed from checkpoint-4, reached step 12")
    figures.add("training SIGKILLed between checkpoints",
                "tests/train/test_train_runs.py::test_sigkill_then_resume_matches_an_uninterrupted_run "
                "(slow; resumes, final loss within 2 % of an uninterrupted run)")
