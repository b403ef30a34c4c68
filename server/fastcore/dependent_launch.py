"""Programmatic dependent launch for a decode step's own kernels (sm_90 and later).

A batch-1 decode step is ~130 short weight kernels (5-120 µs each on an 8B model) with the
attention's between them, and between two kernels the GPU idles: the next kernel starts only
once the last program of the one before has finished, and its first loads then take a memory
round trip before anything streams (bench/RESULTS.md: 245-314 µs of idle in a 2.7-3.4 ms step on
an H100).  With programmatic dependent launch (CUDA's programmatic stream serialization, Triton's
`launch_pdl`) the next kernel may start while the one before still runs: its programs load what
no kernel writes (the weights' first words) and then wait (`griddepcontrol.wait`) until the
kernel before has finished and its writes are visible.  Each program also says, as it waits,
that the next kernel may launch (`griddepcontrol.launch_dependents`): the next kernel launches
once every program of this one has got that far, i.e. during its last wave.

Why it is safe in a chain of such kernels: every program of a kernel launched this way waits
before its first read of another kernel's output and before its first write, so a kernel that
has finished has waited for the one before it, and that one for the one before it.  Kernels
launched the ordinary way (cuBLAS, inductor's) start after the kernel before has finished, as
always.  CUDA graphs keep these launches as programmatic edges.

Launched so: the batch-1 matrix-vector kernels (triton_gemv.py), which load their first weight
words before they wait, and the attention kernel and the merge of its split keys
(triton_paged_attention.py), which wait first.  Only on sm_90 and later (Hopper has the
instructions; a T4, sm_75, does not), on a GPU (not under Triton's interpreter), unless
QUANTSERVE_DEPENDENT_LAUNCH=0.  On by default since measured (bench/RESULTS.md, H100 2026-12-07:
8B int8 batch 1 +2.8 %, 312.5 against 303.9 tok/s; int4 unchanged, 363.1 against 364.4).  The
kernels' K-step SASS is the same with it (sm_90: 141 / 346 instructions for the int8 / int4 dp4a
forms).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FLAG = "PDL"  # the kernels' constexpr parameter: wait where `wait_for_previous` is called


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched this way."""
    if os.environ.get("QUANTSERVE_DEPENDENT_LAUNCH", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return device.type == "cuda" and _capability(device.index or 0) >= (9, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launch_options(fn, device: torch.device) -> dict:
    """The keyword arguments that launch `fn` (a JITFunction) as a dependent launch on `device`:
    its FLAG and Triton's `launch_pdl`; none where `fn` has no FLAG parameter or the device or the
    environment rules it out."""
    if FLAG not in getattr(fn, "arg_names", ()) or not enabled(device):
        return {}
    return {FLAG: True, "launch_pdl": True}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: let the next kernel launch, then wait until the kernel before this one has finished
    and its writes are visible.  Call it in every program, after loads of what no kernel writes (the
    weights) and before any other load or store."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
