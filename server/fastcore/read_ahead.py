"""Checkpoint tensors read ahead of the model build, on worker threads.

Building the model (weights.build_transformer) asks for its tensors one at a time, in an order
known before it starts.  Read in turn on the main thread, each tensor's bytes come out of the
safetensors file's mapping page by page while the copy to the device touches them, and the
device waits for the reading while the reading waits for the last layer's quantization (the 8B
shape's 16 GB took 11 s of a 28 s warm start on an H200).  Here a few threads copy the next
tensors out of the mapping into host memory, pinned when they go to a GPU, so the copy to the
device is one asynchronous DMA; the copies release the GIL, so they run beside the build.  At
most `depth` tensors are ahead of the build: the host memory held is a few layers' worth.

    ahead = ReadAhead(read, pinned=True)
    ahead.start(names)          # the names the build will take, in its order
    host = ahead.take(name)     # that tensor's host copy (waits for it), or None if not planned
    ahead.close()               # the build ended (or failed): stop, let the pinned memory go
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class ReadAhead:
    def __init__(self, read: Callable[[str], torch.Tensor], pinned: bool, threads: int | None = None,
                 depth: int = 8):
        """read: name -> tensor (may be backed by the file's pages; it is copied, never kept);
        pinned: copy into page-locked memory (a CUDA device's asynchronous copies need it)."""
        self._read, self._pinned, self._depth = read, pinned, depth
        self._threads = threads or max(1, min(4, (os.cpu_count() or 1) - 1))
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[str] = deque()
        self._pending: dict[str, Future] = {}

    def start(self, names: list[str]) -> None:
        self._queue.extend(names)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="read-ahead")
        self._fill()

    def take(self, name: str) -> torch.Tensor | None:
        """The host copy of `name` if it was planned (the caller's own copy), else None.  An
        error reading it is raised here, where the build asked for it."""
        future = self._pending.pop(name, None)
        if future is None:
            return None
        try:
            return future.result()
        finally:
            self._fill()

    def close(self) -> None:
        """Stop reading (the build ended, or failed): tensors not taken yet are dropped."""
        self._queue.clear()
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._pinned:
            # the pinned copies went back to torch's host cache, which keeps them for reuse: a
            # server needs none after its load, and they are a few GB of locked memory
            torch.cuda.synchronize()
            empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
                or getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    def _fill(self) -> None:
        while self._queue and len(self._pending) < self._depth:
            name = self._queue.popleft()
            if name not in self._pending:  # planned twice while its read is pending: the second take reads it itself
                self._pending[name] = self._pool.submit(self._copy, name)

    def _copy(self, name: str) -> torch.Tensor:
        src = self._read(name)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=self._pinned)
        host.copy_(src)
        return host
