"""Prompt-sized int8/int4 matmuls with each weight dequantized ahead, on a second CUDA stream.

A long prompt's int8/int4 layers run as dequantize-then-cuBLAS (triton_mm.py's `dense` path): one
pass writes an fp16 copy of the weight, then cuBLAS multiplies it.  In line, the copies add ~40 %
to a 512-token prompt of the 8B shape on an H100 (bench/RESULTS.md, 2026-12-07: 24.2 against
17.2 ms of GPU kernels), and a T4 has no other prompt path that uses its tensor cores.  Yet the
copy only moves bytes, while the prompt's matmuls beside it are bound by their multiply-adds.  So
here the copies of the next layers' weights are written on a second stream, into a ring of
`slots` buffers, while the current layer's matmul and the attention and norms after it run on
the first: the copy overlaps work that leaves memory bandwidth spare.

    ahead = DequantAhead.for_model(model)       # None: no int8/int4 Triton layer, or not on a GPU
    with ahead.forward(tokens):                 # around one forward (graphs.py)
        ... int8_weight_mm(x, w, s) ...         # the op finds it: ahead.mm(x, w) or None

The layers are numbered in the order a forward calls them (each block's wqkv, wo, w13, w2).  A
call out of that order (a layer left out, a caller's own order) starts the ring again at that
layer, so the order changes only how much overlaps, never a result; a weight it does not know (the
vocabulary matmul) goes the usual way.  Inside CUDA graph capture the second stream forks from
the capturing one when a forward starts and joins it when the forward ends, as any multi-stream
capture must; a graph then holds both streams' kernels as parallel branches.

The memory: `slots` buffers the size of the largest such layer's fp16 weight (2 × 224 MiB on the
8B shape), where the in-line path allocated one copy at a time.  QUANTSERVE_DEQUANT_AHEAD=0 turns
it off (prompts then take the launcher's tiles or in-line copies, timed per shape).
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

MIN_ROWS = 256  # tokens in a forward from which its int8/int4 layers take the copies made ahead
_state = threading.local()  # .active: the ring of the forward this thread runs now (set by `forward`)


def enabled() -> bool:
    return os.environ.get("QUANTSERVE_DEQUANT_AHEAD", "1") != "0"


def active(rows: int) -> "DequantAhead | None":
    """The ring a weight op of `rows` rows should take its weight from, if any."""
    ring = getattr(_state, "active", None)
    return ring if ring is not None and rows >= ring.min_rows else None


def to_issue(i: int, issued: int, slots: int, n: int) -> range:
    """Layer i (of n) is called and the copies of layers up to `issued` are on their way: the layers
    whose copies to start now, layer j into slot j % slots.  The ring holds `slots` copies: layer
    i's own and the next slots - 1.  Where i is not among the last `slots` started (the first call
    of a forward, a layer left out or called again), it starts again at i."""
    restart = not issued - slots < i <= issued
    return range(i if restart else issued + 1, min(i + slots, n))


class DequantAhead:
    def __init__(self, layers: list[tuple], device: torch.device, dtype: torch.dtype, slots: int = 2,
                 min_rows: int = MIN_ROWS):
        """layers: (weights "int8" / "int4", its tensors as the op takes them after x, group size or
        None) in the order a forward calls them (quant.triton_layers)."""
        if slots < 2:
            raise ValueError(f"a dequantize-ahead ring needs at least 2 slots, not {slots}")
        self.layers, self.slots, self.min_rows, self.dtype = layers, slots, min_rows, dtype
        self.index = {tensors[0].data_ptr(): i for i, (_, tensors, _) in enumerate(layers)}
        self.shapes = [(t[0].shape[0], t[0].shape[1] * (2 if w == "int4" else 1)) for w, t, _ in layers]
        largest = max(n * k for n, k in self.shapes)
        self.buffers = [torch.empty(largest, device=device, dtype=dtype) for _ in range(slots)]
        self.stream = torch.cuda.Stream(device)
        self._main = None  # the stream the forward runs on (the capturing one under a CUDA graph)
        self._issued = -1
        # each slot's last copy (recorded on the second stream) and last read (on the first).  A
        # wait takes an event's latest record; within a forward each is waited on only after its
        # record in that forward (one recorded outside a CUDA graph's capture cannot be waited on
        # inside it): `_read` says which slots were read in this forward
        self._ready = [torch.cuda.Event() for _ in range(slots)]
        self._free = [torch.cuda.Event() for _ in range(slots)]
        self._read = [False] * slots

    @classmethod
    def for_model(cls, model, slots: int = 2) -> "DequantAhead | None":
        from quantserve.server.fastcore.quant import triton_layers

        layers = triton_layers(model.layers)  # the blocks' layers only: the vocabulary matmul takes few rows
        if not layers or not enabled() or not layers[0][1][0].is_cuda:
            return None
        dtype = layers[0][1][1].dtype  # the scales' dtype is the activations'
        return cls(layers, layers[0][1][0].device, dtype, slots)

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @contextlib.contextmanager
    def forward(self, tokens: int):
        """Around one forward of `tokens` tokens on the current stream: the weight ops inside it
        take their copies from this ring when the forward is long enough."""
        if tokens < self.min_rows:
            yield
            return
        self._main = torch.cuda.current_stream(self.buffers[0].device)
        self.stream.wait_stream(self._main)  # fork: the copies come after whatever came before
        self._read = [False] * self.slots
        self._issued, _state.active = -1, self
        try:
            yield
        finally:
            _state.active = None
            self._main.wait_stream(self.stream)  # join: no copy outlives the forward

    def mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T for the layer whose stored weight is `weight`, from its copy in the ring, the next
        layers' copies started behind it; None for a weight not in the ring."""
        i = self.index.get(weight.data_ptr())
        if i is None or x.dtype != self.dtype:
            return None
        for j in to_issue(i, self._issued, self.slots, len(self.layers)):
            self._issue(j)
        slot = i % self.slots
        self._main.wait_event(self._ready[slot])
        n, k = self.shapes[i]
        y = torch.mm(x, self.buffers[slot][:n * k].view(n, k).t())
        self._free[slot].record(self._main)  # the slot may take another copy once this matmul has read it
        self._read[slot] = True
        return y

    def _issue(self, j: int) -> None:
        from quantserve.server.fastcore.triton_dequant import dequantize_int4, dequantize_int8

        slot = j % self.slots
        weights, tensors, group = self.layers[j]
        n, k = self.shapes[j]
        out = self.buffers[slot][:n * k].view(n, k)
        with torch.cuda.stream(self.stream):
            if self._read[slot]:
                self.stream.wait_event(self._free[slot])  # the matmul that last read this slot
            if weights == "int8":
                dequantize_int8(*tensors, self.dtype, out=out)
            else:
                dequantize_int4(*tensors, group, self.dtype, out=out)
            self._ready[slot].record(self.stream)
        self._issued = j
