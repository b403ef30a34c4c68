"""Process-group plumbing: one process or many, launched by torchrun, the deepspeed launcher or us.

Two traps live here (both verified on GPU-less hosts):
- DeepSpeed in a single process without a launcher wants RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*
  (otherwise it goes looking for MPI), so `single_process_env()` supplies them.
- With no GPU, accelerate's `PartialState` initialised for DeepSpeed reports `num_processes = 1`
  although DeepSpeed's gloo group has N ranks, so the Trainer's sampler gives every rank the
  whole, identical data.  `fix_accelerate_state()` copies the truth from `torch.distributed`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from quantserve.settings import UserError, free_port


def world() -> tuple[int, int, int]:
    """(world size, rank, local rank) from the launcher's environment; (1, 0, 0) without one."""
    return (int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)))


def log(msg: str) -> None:
    """A line on stderr from rank 0 only (every rank runs the same recipe)."""
    if world()[1] == 0:
        print(msg, file=sys.stderr, flush=True)


def launched() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def single_process_env() -> None:
    """Make a launcher-less process look like rank 0 of a world of 1 (what DeepSpeed expects)."""
    if launched():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def fix_accelerate_state(args) -> None:
    """After `TrainingArguments` built accelerate's state, make it agree with torch.distributed."""
    import torch.distributed as dist

    state = args.distributed_state
    if state is None or not dist.is_initialized():
        return
    ws, rank = dist.get_world_size(), dist.get_rank()
    if state.num_processes != ws or state.process_index != rank:
        # PartialState keeps its fields in a class-wide dict: setting them here is seen by the
        # Accelerator the Trainer creates next, and so by its data-loader sharding.
        state.num_processes = ws
        state.process_index = rank
        state.local_process_index = int(os.environ.get("LOCAL_RANK", rank))
        state.backend = dist.get_backend()


def launch(argv: list[str], nproc: int, hostfile: Path | None, master_port: int | None = None) -> int:
    """Re-run `quantserve <argv>` on `nproc` processes per node (and the hosts of a hostfile).

    One node: torchrun (ships with torch).  Several nodes: DeepSpeed's own launcher, which reads
    the hostfile (`host slots=N` lines) and starts the same command everywhere over ssh/pdsh.
    """
    port = str(master_port or free_port())
    if hostfile is not None:
        check_hostfile(hostfile)
        exe = deepspeed_launcher()
        if exe is None:
            raise UserError("multi-node runs use DeepSpeed's launcher: install deepspeed (quantserve[train])")
        cmd = [exe, "--hostfile", str(hostfile), "--num_gpus", str(nproc), "--master_port", port,
               "--module", "quantserve"] + argv
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", port, "-m", "quantserve"] + argv
    env = dict(os.environ, QUANTSERVE_LAUNCHED="1")
    # Without a GPU DeepSpeed must be told to use its CPU accelerator (gloo + shared memory).
    if not _cuda_visible():
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # stdout is the command's answer (the output folder, printed once by this process): what the
    # ranks' libraries print there (DeepSpeed's op builds, per rank) goes to stderr
    return subprocess.call(cmd, env=env, stdout=sys.stderr.fileno())


def check_hostfile(hostfile: Path) -> None:
    """Refuse a hostfile DeepSpeed's launcher cannot read, naming the line: DeepSpeed's own error
    is a traceback from inside its launcher."""
    if not hostfile.is_file():
        raise UserError(f"{hostfile}: no such hostfile")
    try:
        lines = hostfile.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{hostfile}: not UTF-8 text") from None
    hosts = 0
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()  # comments and blank lines are allowed
        if not line:
            continue
        if not re.fullmatch(r"\S+\s+slots=[1-9]\d*", line):
            raise UserError(f"{hostfile}:{n}: expected 'hostname slots=N' (N at least 1), not {line!r}")
        hosts += 1
    if not hosts:
        raise UserError(f"{hostfile}: no hosts (expected lines of 'hostname slots=N')")


def deepspeed_launcher() -> str | None:
    """The `deepspeed` script: on PATH, or beside this Python (a virtualenv run by its absolute
    path, never activated, is not on PATH)."""
    beside = Path(sys.executable).parent / "deepspeed"
    return shutil.which("deepspeed") or (str(beside) if os.access(beside, os.X_OK) else None)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def gather(obj) -> list:
    """`obj` from every rank, in rank order (a one-element list without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
