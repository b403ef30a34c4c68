"""How the weight kernels' candidates are timed at start-up (triton_mm._launch and the autotuners).

Two timers, for two kinds of question:

- `quick_bench` (Triton's do_bench, shortened): one config of one kernel against another, each a
  single launch.  Every call is timed by its own pair of CUDA events after an L2-flushing memset;
  while the GPU clears that buffer the CPU has queued the launch, so the events see GPU time.
- `graph_times` (CUDA graphs): whole calls that differ in how many kernels they launch, such as a
  split-K tiled kernel (the kernel and the adding of its splits, triton_splits.py; then a
  zero-fill, the kernel and a cast) against the few-rows kernel (one).  Timed one by one, a call
  whose Python and launches take longer than the flush runs with gaps the events count: on an
  H200 the launcher kept the few-rows kernel for the 8B's o layer at 16 rows (27.6 µs as a decode
  step replays it) over the tiled one (16.6 µs), and more such choices at 8 and 16 rows during a
  cold start, while compile threads held the GIL (bench/RESULTS.md, 2026-12-06).  Decode and
  prompt steps replay their kernels from CUDA graphs, with no launch gaps; so every candidate is
  timed the same way: `REPS` calls, each after the flush, in one graph, less the same graph of
  flushes alone (prompt-sized ones too since 2026-12-07: the wgmma kernels' host-side TMA
  descriptors had lost them a layer to a form 1.27x slower).
"""

from __future__ import annotations

import sys

REPS = 8  # calls per graph: ~0.1-2 ms of GPU time for a decode-sized layer, flushes included
REPLAYS = 5  # the best replay of each graph is kept (the least disturbed by anything else on the GPU)


def quick_bench(kernel_call, quantiles=None):
    """The weight kernels' timer at start-up.  Triton's default runs every candidate for 25 ms of
    warm-up and 100 ms of timing; over the ~50 (layer shape, forward size) pairs a model tunes,
    with 3-7 candidates each, that was most of a cold start's ~30 s of tuning.  A weight kernel
    runs for 5-600 µs, so 20 ms still averages 30 or more calls (the L2 cache flushed between
    them, as do_bench does)."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _flush_buffer():
    """A buffer twice the L2 cache (32 MB at least): zeroing it evicts the weights of the call
    before, as a decode step's other layers do."""
    import torch

    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    return torch.empty(max(2 * l2, 32 << 20) // 4, dtype=torch.int32, device="cuda")


def best_replay_ms(graph, replays: int = REPLAYS) -> float:
    """ms of the best of `replays` replays of a captured CUDA graph, after one untimed replay."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _replay_ms(body, flush) -> float:
    """ms of the best replay of one CUDA graph of REPS (flush, body()) pairs."""
    import torch

    graph = torch.cuda.CUDAGraph()
    # thread_local: a loader or compile thread's CUDA calls meanwhile do not void this capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(REPS):
            flush.zero_()
            body()
    return best_replay_ms(graph)


def graph_times(calls: list) -> list[float]:
    """ms per call of each of `calls` as a CUDA graph replays it, the L2 cache flushed before each
    call.  Each call must already have run once (compiled, its kernels loaded: a capture cannot
    load them).  Where a capture fails (a call this Triton or torch cannot capture), all of
    `calls` are timed by quick_bench instead, and said so on stderr: a candidate is never lost
    to the timer."""
    import torch

    try:
        flush = _flush_buffer()
        base = _replay_ms(lambda: None, flush)
        return [max(_replay_ms(call, flush) - base, 0.0) / REPS for call in calls]
    except Exception as e:  # noqa: BLE001  (CUDA's capture errors and Triton's launch errors have no common base)
        torch.cuda.synchronize()
        print(f"warning: timing weight-kernel candidates in a CUDA graph failed ({str(e)[:200]}); "
              "timed one call at a time instead", file=sys.stderr)
        return [quick_bench(call) for call in calls]
