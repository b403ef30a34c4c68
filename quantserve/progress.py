"""Progress for long work: a tqdm bar on a terminal, a status line every ~30 s anywhere else.

A bar redrawn with carriage returns fills a piped log or a CI log with thousands of fragments;
there, one line now and then (and one at the end) says the same.
"""

from __future__ import annotations

import contextlib
import sys
import time


class Progress:
    def __init__(self, total: int | None, desc: str, unit: str = "step", enabled: bool = True,
                 initial: int = 0, every_s: float = 30.0):
        self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
        self.n, self.every_s, self.status = initial, every_s, ""
        self.t0 = self.t_said = time.monotonic()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int, status: str = "") -> None:
        """`n` units done so far (not an increment); `status` shown after the count."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n - self.bar.n)
            if status:
                self.bar.set_postfix_str(status)
            return
        self.n, self.status = n, status
        if time.monotonic() - self.t_said >= self.every_s:
            self._say()

    def set_total(self, total: int) -> None:
        """The work turned out to end elsewhere (a training run's gate stops it early)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled:
            self._say()
        self.enabled = False

    def _say(self) -> None:
        self.t_said = time.monotonic()
        of = f"/{self.total}" if self.total else ""
        status = f", {self.status}" if self.status else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}s{status} ({time.monotonic() - self.t0:.0f} s)",
              file=sys.stderr, flush=True)


def track(items, desc: str, unit: str = "item", total: int | None = None, enabled: bool = True):
    """Iterate `items` with a `Progress` (a generator is never listed: its total may stay unknown)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    prog = Progress(total, desc, unit, enabled)
    try:
        for i, item in enumerate(items):
            yield item
            prog.update(i + 1)
    finally:
        prog.close()


def bars_wanted(progress: bool) -> bool:
    """Whether a library may draw its own bar (gguf's writer, transformers' loading and saving):
    only when progress is asked for and stderr is a terminal."""
    return progress and sys.stderr.isatty()


@contextlib.contextmanager
def transformers_bars(progress: bool):
    """transformers' own bars ("Loading weights", "Writing model shards") on or off for a block,
    and back to what they were after it (turning them on unasked, off a terminal, undoes the
    quiet that HF_HUB_DISABLE_PROGRESS_BARS gave every later load)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if bars_wanted(progress):
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not hf_logging.is_progress_bar_enabled():
            hf_logging.enable_progress_bar()
        elif not was and hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
