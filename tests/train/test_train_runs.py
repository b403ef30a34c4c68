"""Real training runs on the CPU: 2-process ZeRO-2 / ZeRO-3 over gloo, LoRA + merge, kill and resume.

Each run goes through the `quantserve train` command (torchrun under `--nproc 2`), then the saved
checkpoint is reloaded and compared with the logits the in-memory model produced at the end of
training (`train_log.json` → `probe`): the save must write the weights that were trained.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantserve.training.config import TrainConfig as D

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, default_model) -> Path:
    from quantserve.demo.corpus import task_examples, write_jsonl

    path = tmp_path_factory.mktemp("data") / "task.jsonl"
    write_jsonl(path, task_examples(256, "train"))
    return path


def run_train(*args, timeout=600, quiet=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "quantserve", "train", *(["--quiet"] if quiet else []), *args],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(out: Path) -> list[float]:
    return [s["loss"] for s in json.loads((out / "train_log.json").read_text())["steps"]]


def assert_reload_matches(out: Path, atol=1e-4) -> None:
    import torch

    from quantserve.modeling import load_model

    log = json.loads((out / "train_log.json").read_text())
    model = load_model(out)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([log["probe"]["input_ids"]])).logits[0, -1]
    expected = torch.tensor(log["probe"]["last_logits"])
    assert torch.allclose(logits, expected, atol=atol), (logits - expected).abs().max()


def assert_learns(out: Path) -> None:
    ls = losses(out)
    first, last = sum(ls[:2]) / 2, sum(ls[-2:]) / 2
    assert last < 0.9 * first, ls  # the task is hard: a clear but modest drop in 8 steps


@pytest.mark.parametrize("zero", [2, 3])
def test_two_process_zero(zero, small_data, tmp_path):
    out = tmp_path / f"zero{zero}"
    r = run_train("--data", str(small_data), "--out", str(out), "--zero", str(zero), "--nproc", "2",
                  "--max-steps", "8", "--micro-batch", "8", "--lr", "3e-3", "--audit-data")
    # stdout is the answer alone; the ranks' libraries do not print each line twice (or per call)
    assert r.stdout.strip() == str(out), r.stdout
    lines = [line for line in r.stderr.splitlines() if len(line.strip()) > 40]
    assert len(lines) == len(set(lines)), r.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["world_size"] == 2 and log["global_step"] == 8 and log["zero"] == zero
    # a full fine-tune trains every parameter, ZeRO-3's partitioned ones included (once reported as 0)
    assert log["trainable_params"] == log["params"] > 3e6, (log["trainable_params"], log["params"])
    # Every rank's memory report reached rank 0 (the figures themselves exist on GPUs only).
    assert [m["rank"] for m in log["gpu_memory"]] == [0, 1]
    assert_learns(out)
    assert_reload_matches(out)
    # The two ranks trained on different examples: no example index appears on both.
    seen = [json.loads((out / "data_audit" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(len(s) >= 8 * 8 for s in seen)
    assert not set(seen[0]) & set(seen[1])


def test_lora_adapter_and_merge(small_data, tmp_path):
    out = tmp_path / "lora"
    run_train("--data", str(small_data), "--out", str(out), "--method", "lora", "--merge",
              "--max-steps", "8", "--micro-batch", "8", "--lr", "5e-3")
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    log = json.loads((out / "train_log.json").read_text())
    assert log["trainable_params"] < log["params"] / 5
    assert_learns(out)
    assert_reload_matches(out)


def test_sigkill_then_resume_matches_an_uninterrupted_run(small_data, tmp_path):
    common = ["--data", str(small_data), "--max-steps", "12", "--micro-batch", "8", "--save-steps", "4"]
    ref = tmp_path / "ref"
    run_train(*common, "--out", str(ref))

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "quantserve", "train", "--quiet", *common, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 300
    # Wait for a complete checkpoint (trainer_state.json is written last), then kill mid-run.
    while not (out / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "train_log.json").exists(), "the run finished before the kill"

    run_train(*common, "--out", str(out))
    log = json.loads((out / "train_log.json").read_text())
    ref_log = json.loads((ref / "train_log.json").read_text())
    assert log["resumed_from"] and "checkpoint-" in log["resumed_from"]
    assert log["global_step"] == ref_log["global_step"] == 12
    assert len(losses(out)) == len(losses(ref)) == 12  # the log covers the whole run
    assert abs(losses(out)[-1] - losses(ref)[-1]) <= 0.02 * losses(ref)[-1] + 1e-3


def test_ctrl_c_says_where_the_same_command_resumes(small_data, tmp_path):
    """Ctrl-C mid-run: exit 130 with one line naming the checkpoint a rerun resumes from."""
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "quantserve", "train", "--quiet", "--data", str(small_data),
                             "--max-steps", "400", "--micro-batch", "8", "--save-steps", "4", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            # as from a terminal: the suite's workers run with SIGINT ignored, which a child inherits
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not (out / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "no checkpoint to resume from"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    line = next(x for x in err.splitlines() if x.startswith("interrupted: "))
    step = int(re.search(r"checkpoint-(\d+)", line).group(1))
    assert step >= 4 and (out / f"checkpoint-{step}" / "trainer_state.json").is_file() and "Traceback" not in err


def test_rerun_of_a_finished_train_is_a_no_op_and_force_retrains(small_data, tmp_path):
    """Rerunning a finished command must not resume from its last checkpoint, train one step more
    and overwrite the model; --force trains again from the start."""
    out = tmp_path / "ft"
    args = ("--data", str(small_data), "--out", str(out), "--max-steps", "4", "--save-steps", "2",
            "--micro-batch", "4")
    run_train(*args)
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by others (safetensors writes 0600)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = run_train(*args)
    assert "already trained" in again.stderr and "4 steps" in again.stderr, again.stderr[-1000:]
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((out / "train_log.json").read_text())["global_step"] == 4
    # the same settings from a --config file are the same run; a flag beside it overrides the file
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"data": str(small_data), "out": str(out), "max_steps": 4, "save_steps": 2,
                                  "micro_batch": 4, "lr": 7e-4}))
    assert "already trained" in run_train("--config", str(config), "--lr", str(D.lr)).stderr
    from_file = subprocess.run([sys.executable, "-m", "quantserve", "train", "--quiet", "--config", str(config)],
                               capture_output=True, text=True, timeout=300)
    assert from_file.returncode == 1 and "different --lr" in from_file.stderr, from_file.stderr[-500:]
    # another config (or other data) in the same folder is a new run, not a no-op
    changed = small_data.with_name("changed.jsonl")
    changed.write_text("".join(small_data.read_text().splitlines(keepends=True)[1:]))  # one record less
    # without --force it is refused: resuming the old run's checkpoint-4 would train nothing and
    # leave the old model under the new command (and another --lr likewise)
    for extra in (("--data", str(changed), *args[2:]), (*args, "--lr", "7e-4")):
        refused = subprocess.run([sys.executable, "-m", "quantserve", "train", "--quiet", *extra],
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1 and "holds a run of another config" in refused.stderr, refused.stderr[-500:]
        assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert "its data differs" in subprocess.run(
        [sys.executable, "-m", "quantserve", "train", "--quiet", "--data", str(changed), *args[2:]],
        capture_output=True, text=True, timeout=300).stderr
    other = run_train("--data", str(changed), *args[2:], "--force")
    assert "already trained" not in other.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["global_step"] == 4 and log["resumed_from"] is None


def test_a_run_that_stopped_before_its_first_checkpoint_does_not_hold_its_folder(small_data, tmp_path):
    """A run that failed (or was interrupted) before saving anything left only run.json: a rerun with
    changed settings (a smaller --micro-batch after running out of memory) trains there without
    --force.  Once a checkpoint exists, the folder is that run's."""
    from quantserve.training.config import TrainConfig
    from quantserve.training.runs import RUN_FILE, other_run, run_identity

    out = tmp_path / "ft"
    out.mkdir()
    (out / RUN_FILE).write_text(json.dumps(run_identity(TrainConfig(data=small_data, out=out, micro_batch=8))))
    smaller = TrainConfig(data=small_data, out=out, micro_batch=4)
    assert other_run(smaller) is None
    (out / "checkpoint-2").mkdir()
    assert other_run(smaller) == "different --micro-batch"


def test_eval_gate_stops_the_run_once_the_target_is_reached(small_data, tmp_path):
    """The gate scores the eval file every --eval-steps and stops there once the target is met.

    The eval file is the training file's first records, which a 24-step full fine-tune at a high
    rate answers only partly: the target is set just under what the first check scores (measured
    from a run without a target), so the first check must stop the run and a later one must not run.
    """
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(small_data.read_text().splitlines(keepends=True)[:40]))
    free = tmp_path / "free"
    run_train("--data", str(small_data), "--out", str(free), "--max-steps", "24", "--eval-data", str(eval_file),
              "--eval-steps", "12", "--lr", "3e-3", "--save-steps", "0")
    checks = json.loads((free / "train_log.json").read_text())["eval"]
    assert [c["step"] for c in checks] == [12, 24]  # no target: every check runs, the bound ends it
    first = checks[0]["eval_exact_match"]
    if first == 0:
        pytest.skip("nothing answered after 12 steps: no reachable target to stop at")
    gated = tmp_path / "gated"
    r = run_train("--data", str(small_data), "--out", str(gated), "--max-steps", "24", "--eval-data", str(eval_file),
                  "--eval-steps", "12", "--lr", "3e-3", "--save-steps", "0", "--stop-at-exact-match", str(first))
    log = json.loads((gated / "train_log.json").read_text())
    assert log["global_step"] == 12 and [c["step"] for c in log["eval"]] == [12], log["eval"]
    assert "reached, stopping" in r.stderr
    assert_reload_matches(gated)  # the saved model is the one that passed the gate
    # with a cooldown the run goes on past the gate, the rate decaying to zero, then stops
    cooled = tmp_path / "cooled"
    r = run_train("--data", str(small_data), "--out", str(cooled), "--max-steps", "24", "--eval-data", str(eval_file),
                  "--eval-steps", "12", "--lr", "3e-3", "--save-steps", "0", "--stop-at-exact-match", str(first),
                  "--gate-cooldown", "0.5", quiet=False)
    log = json.loads((cooled / "train_log.json").read_text())
    assert log["global_step"] == 18 and "cooling the learning rate down to 0 over 6 steps" in r.stderr
    # the progress (piped: a status line) counts to where the gate ends the run, not to --max-steps
    assert re.search(r"^train: 18/18 steps, loss [0-9.]+ .*ETA 0:00", r.stderr, re.M), r.stderr[-1500:]
    # bitsandbytes' notice (AVX-512 BF16 CPUs) that it could not download a kernel it never needs
    assert "kernels-community" not in r.stderr
    rates = [s["learning_rate"] for s in log["steps"] if s["step"] >= 12]
    assert all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] < rates[0] / 5, rates  # the last step at 1/6
    assert_reload_matches(cooled)
