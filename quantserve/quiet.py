"""Library noise, filtered once at its source, so logs carry what a person needs to read.

- bitsandbytes logs "MatMul8bitLt: inputs will be cast ..." on every int8 matmul of an fp32 input
  (thousands of lines for a few requests): shown once per process, then dropped.
- transformers' and the hub's progress bars, off when stderr is not a terminal.
- DeepSpeed, imported by transformers whenever it is installed, prints "Setting accelerator to
  CPU" on *stdout* (inside tables other programs read) on every machine without a GPU: telling it
  the accelerator up front (`DS_ACCELERATOR=cpu`, its own switch) makes it choose silently.
Every command calls `quiet_libraries()` first; it imports none of these libraries.
"""

from __future__ import annotations

import glob
import logging
import os


class OncePerMessage(logging.Filter):
    """Let each distinct message format through once."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes, self.seen = prefixes, set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith(self.prefixes):
            return True
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


def has_gpu_device() -> bool:
    """An NVIDIA or AMD GPU device node, without importing torch."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def quiet_libraries() -> None:
    import sys

    if not sys.stderr.isatty():
        # transformers' and the hub's own bars ("Loading weights", "Writing model shards") are
        # carriage-return spam in a log; ours print status lines there instead (progress.py)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not has_gpu_device():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(OncePerMessage(("MatMul8bitLt:",)))
