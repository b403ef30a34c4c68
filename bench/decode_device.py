"""The device side of `bench decode` (decode.py): waiting for the GPU, the copy bandwidth its
rooflines divide by, the T4 profile's memory cap lifted for rows that cannot fit it, and the memory
given back between rows.  torch is imported inside each function: `--help` stays instant."""

from __future__ import annotations

import gc
import time


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, gib: float = 1.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (a copy reads and writes each byte: 2x)."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.ones(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    dt = time.perf_counter() - t0
    del src, dst
    return 2 * n * 2 * iters / dt


class Cap:
    """The T4 profile's memory cap, lifted on request for rows that cannot fit it (fp16 8B)."""

    def __init__(self, caps):
        self.caps = caps

    def set(self, on: bool) -> None:
        import torch

        if self.caps.device != "cuda" or self.caps.profile != "t4":
            return
        gc.collect()
        torch.cuda.empty_cache()
        frac = min(1.0, self.caps.memory_budget_gib / self.caps.gpu_memory_gib) if on else 1.0
        torch.cuda.set_per_process_memory_fraction(frac, 0)

    @property
    def active(self) -> bool:
        return self.caps.device == "cuda" and self.caps.profile == "t4"


def free(device) -> None:
    import torch

    torch._dynamo.reset()  # drops the previous engine's compiled code
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
