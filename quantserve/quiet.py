"""Library noise, filtered once at its source, so logs carry what a person needs to read.

- bitsandbytes logs "MatMul8bitLt: inputs will be cast ..." on every int8 matmul of an fp32 input
  (thousands of lines for a few requests): shown once per process, then dropped.
- bitsandbytes, on CPUs with AVX-512 BF16, tries to download a faster 4-bit CPU kernel from the
  Hugging Face Hub (the `kernels` package) and logs a warning when it cannot; it then uses its own
  kernel, which is what runs offline anyway: that warning is dropped.
- transformers' and the hub's progress bars, off when stderr is not a terminal.
- DeepSpeed, imported by transformers whenever it is installed, prints "Setting accelerator to
  CPU" on *stdout* (inside tables other programs read) on every machine without a GPU: telling it
  the accelerator up front (`DS_ACCELERATOR=cpu`, its own switch) makes it choose silently.
- DeepSpeed's ZeRO calls torch collectives torch has deprecated: that FutureWarning once, not per call.
- Under `--nproc N` every process imports the same libraries and would print the same warnings N
  times: ranks other than 0 keep only errors (what transformers' `log_level_replica` does for its
  own logger, here for every library's, Python warnings included).
Every command calls `quiet_libraries()` first; it imports none of these libraries.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings


class DropMessages(logging.Filter):
    """Drop the messages that start with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


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


# warnings that our own settings cause: huggingface_hub says so when transformers asks for the
# progress bars that HF_HUB_DISABLE_PROGRESS_BARS (which quiet_libraries sets off a terminal) turned off
OWN_DOING = ("Cannot enable progress bars",)


def _once_per_message(show):
    seen: set[tuple[type, str]] = set()

    def showwarning(message, category, *args, **kwargs):
        key = (category, str(message))
        if key not in seen and not str(message).startswith(OWN_DOING):
            seen.add(key)
            show(message, category, *args, **kwargs)

    return showwarning


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
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(DropMessages(("Failed to load CPU gemm_4bit_forward",)))
    # DeepSpeed's ZeRO calls torch collectives that torch has renamed: a FutureWarning per call
    # (dozens per step), about DeepSpeed's code, not the user's.  A filter does not hold (they are
    # printed even under PYTHONWARNINGS=ignore), so the printer itself shows each message once.
    warnings.showwarning = _once_per_message(warnings.showwarning)
    if os.environ.get("RANK", "0") != "0":
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        if os.environ.get("QUANTSERVE_LAUNCHED"):  # rank 0 prints the same lines to stdout
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
