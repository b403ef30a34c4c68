"""FastCore's forward steps, compiled (torch.compile) and, for decode steps on a GPU, replayed from
CUDA graphs.

    mixed   any flattened batch (prompt chunks and decodes together): on a GPU with the Triton
            attention, one CUDA graph per token bucket (TOKEN_BUCKETS), the batch padded to it
    decode  one token for each of B sequences: on a GPU with the Triton attention, two CUDA graphs
            per batch bucket (BATCH_BUCKETS): for sequences of up to a short context (the
            attention reads all of a sequence's keys in one program) and for longer ones (the
            keys split over programs and merged: attention.short_context)
    Every graph is recorded at warm-up.

What is compiled is one transformer block, not the whole model ("regional compilation"): every
layer runs the same code on its own weights, which dynamo takes as inputs, so one compiled block
serves them all, with dynamic shapes for any number of tokens and sequences (two graphs: torch
specializes a size of 1, a decode of one sequence).  The whole model compiled as one graph took
four compiles of every layer unrolled, minutes on an 8B model even with a warm cache; a block
compiles in seconds.  The embedding, the rotary lookups and the vocabulary matmul around the
blocks run eagerly: a few kernels per forward.

A decode step is where launch overhead hurts (~10 kernels a layer for little GPU work each), so
it replays as one graph; a graph has fixed shapes, so the batch is padded to the next bucket, the
padding rows reading and writing the cache's trash block (model.py).  The attention kernel reads
each sequence's length and blocks from the batch, so one graph serves every context length
on its side of the short context.
A step that carries a prompt chunk costs as much in launches, and more: each compiled block's call
checks dynamo's guards and runs inductor's and our kernels' Python launchers, ~0.3-0.5 ms a layer
on the host whatever the tokens (a 20-token chunk beside 31 decodes took ~20 ms on the 8B shape,
whose GPU work is ~6 ms).  So mixed steps replay graphs too, padded to a token bucket: the
padding tokens are one extra sequence on the trash row, the sequences padded to max_seqs + 1, the
attention's work list to what the bucket can need (batch.padded_inputs).
"""

from __future__ import annotations

import bisect
import contextlib
import warnings

import torch

from quantserve.server.fastcore.attention import short_context
from quantserve.server.fastcore.batch import (StepBatch, batch_of, build_batch, decode_batch, decode_tiles,
                                              padded_inputs, prompt_tile)
from quantserve.server.fastcore.blocks import BLOCK

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# a mixed step's tokens, padded: the powers of two and the midpoints between them (vLLM captures
# graphs at fine steps too), so a step computes ~17 % padding on average instead of ~33 % (a
# 690-token prompt alone ran as 1,024 tokens; now 768)
TOKEN_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


class Steps:
    """The compiled steps of one model and cache, and the CUDA graphs recorded for them."""

    def __init__(self, model, device: torch.device, max_seqs: int, compile: bool, graphs: bool,
                 weight_quant: str, quant_kernel: str, max_tokens: int = 2048, groups: int = 1):
        """max_tokens: the most tokens one forward takes; groups: query heads per KV head."""
        self.model, self.device, self.compile, self.groups = model, device, compile, groups
        self.compile_mixed = compile  # off: prompt steps eagerly (benches that time decode alone)
        self.trash_row = max_seqs  # the block table's padding row (every entry the trash block)
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_seqs) + (max_seqs,)
        # (batch bucket, short context?) -> (graph, its input buffer, its logits)
        self.graphs: dict[tuple[int, bool], tuple] = {}
        # the blocks of the short context: the attention's size carrier in the short graphs (one
        # more in the others), read by the kernel's launcher as the most keys a sequence holds
        self.short_blocks = short_context() // BLOCK
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self._side = None  # the stream the graphs' warm-up runs go on (_capture)
        # mixed steps: a bucket must exceed the tokens it holds (one padding token at least)
        self.mixed_graphs = graphs and compile
        self.token_buckets = tuple(b for b in TOKEN_BUCKETS if b <= max_tokens) + (-(-(max_tokens + 1) // 16) * 16,)
        self.seq_pad = max_seqs + 1 + (max_seqs + 1) % 2  # max_seqs and a padding sequence, an even count (alignment)
        self.mixed_steps: dict[int, tuple] = {}  # token bucket -> (graph, input buffers, logits)
        if compile:
            # gpt-fast's setting: coordinate-descent tuning makes inductor turn 1-row matmuls into
            # fused reductions (int8/int4 dequant folded in).  With the Triton int8/int4 kernels no
            # weight matmul is left for it to fuse, and the tuning only costs compile time.  No
            # inductor CUDA graphs (cudagraph trees assert when the scheduler thread replays a
            # graph recorded on another thread, pytorch#123177): decode_graph records its own.
            fuse = weight_quant == "none" or quant_kernel not in ("triton", "gemlite")
            options = {"coordinate_descent_tuning": fuse, **_cpu_compile_options(device)}
            # the graphs are few (sizes of 1 are specialized; Gemma's window layers differ), but
            # more than dynamo's default limit of 8 would silently run eagerly
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            # quant.triton_ops() is a functools.cache over an import; dynamo traces through the
            # cache and says so at every start ("silent incorrectness is a potential risk"): for
            # a function that returns the same module every time, it is none
            warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools\.lru_cache`")
            for layer in model.layers:  # compiled on first call; every layer finds the same graphs
                layer.compile(fullgraph=True, dynamic=True, options=options)

    def padded_batch(self, n: int) -> int:
        """The batch bucket that holds n sequences."""
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _forward(self, batch: StepBatch, eager: bool = False) -> torch.Tensor:
        """The model's forward, through the compiled blocks unless `eager`."""
        stance = torch.compiler.set_stance("force_eager") if eager or not self.compile else contextlib.nullcontext()
        # no "duck sizing": a step whose token count equals its sequence count (all decodes) must
        # not tie the two sizes together for the steps after it
        with stance, torch.fx.experimental._config.patch(use_duck_shape=False):
            return self.model(batch)

    # ---- any batch -----------------------------------------------------------------------------
    def run_mixed(self, entries: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Each (row, ids, first position) entry's tokens in one forward -> the logits at each
        entry's last token, [len(entries), vocab]."""
        n = sum(len(ids) for _, ids, _ in entries)
        if not (self.mixed_graphs and self.compile_mixed and n < self.token_buckets[-1]):
            batch = build_batch(entries, self.device, self.groups)
            return self._forward(batch, eager=not self.compile_mixed)
        tokens = self.token_buckets[bisect.bisect_right(self.token_buckets, n)]
        graph, (flat, tiles), out = self.mixed_graph(tokens)
        host_flat, host_tiles = padded_inputs(entries, tokens, self.seq_pad, tiles.shape[0], self.groups,
                                              self.trash_row)
        flat.copy_(host_flat, non_blocking=True)
        tiles.copy_(host_tiles, non_blocking=True)
        graph.replay()
        # the logits live in the graph's own buffer, which the next replay overwrites: a copy
        return out[:len(entries)].float()

    def mixed_graph(self, tokens: int) -> tuple:
        """The CUDA graph of a mixed step padded to `tokens` tokens, recorded on first use (warm-up)."""
        if tokens not in self.mixed_steps:
            n_tiles = tokens // prompt_tile(self.groups) + self.seq_pad
            flat, tiles = padded_inputs([], tokens, self.seq_pad, n_tiles, self.groups, self.trash_row)
            flat, tiles = flat.to(self.device), tiles.to(self.device)
            # size carriers of the reference attention; the Triton kernel reads the tiles instead
            two = torch.arange(2, device=self.device)

            def step(flat, tiles):
                return self._forward(batch_of(flat, tiles, tokens, self.seq_pad, two, two))

            graph, out = self._capture(step, flat, tiles)
            self.mixed_steps[tokens] = (graph, (flat, tiles), out, two)
        return self.mixed_steps[tokens][:3]

    # ---- decode --------------------------------------------------------------------------------
    def decode(self, entries: list[tuple[int, list[int], int]], kv_blocks: int) -> torch.Tensor:
        """One token for each (row, [token], position) entry -> logits [len(entries), vocab].
        kv_blocks: the most blocks one of them spans after the step (the reference attention's
        size; the graphs' kernel reads each sequence's own)."""
        n = len(entries)
        inputs = self.decode_inputs([row for row, _, _ in entries], [start for _, _, start in entries],
                                    [ids[0] for _, ids, _ in entries])
        out = self.decode_raw(inputs, kv_blocks)[:n]
        # a graph's logits live in its own buffer, which the next replay overwrites: a copy
        return out.clone() if self.pool is not None and out.dtype == torch.float32 else out.float()

    def decode_inputs(self, rows: list[int], positions: list[int], tokens) -> torch.Tensor:
        """decode_raw's input on the device, [3, B] (B: the bucket that holds the rows): each row
        fed tokens[i] at positions[i]; `tokens` a host list, or a device tensor (the previous step's
        picks, never brought to the host)."""
        n = len(rows)
        host = torch.zeros((3, self.padded_batch(n)), dtype=torch.long)
        host[2] = self.trash_row  # padding rows: position 0 of the trash row
        host[1, :n] = torch.tensor(positions)
        host[2, :n] = torch.tensor(rows)
        if not torch.is_tensor(tokens):
            host[0, :n] = torch.tensor(tokens)
        inputs = host.to(self.device, non_blocking=True)
        if torch.is_tensor(tokens):
            inputs[0, :n] = tokens
        return inputs

    def decode_raw(self, inputs: torch.Tensor, kv_blocks: int) -> torch.Tensor:
        """The decode step on a device tensor [3, B] (tokens, positions, block-table rows; B a
        bucket), with no host sync (benchmarks loop on it).  Returns the logits in the step's own
        output buffer: copy before the next call."""
        B = inputs.shape[1]
        if self.pool is None:
            blocks = torch.arange(kv_blocks, device=self.device)
            return self._decode(inputs, decode_tiles(B, self.device), blocks)
        graph, static, out = self.decode_graph(B, kv_blocks <= self.short_blocks)
        static.copy_(inputs, non_blocking=True)
        graph.replay()  # the whole step, ~10 kernels per layer, in one launch
        return out

    def warm_decode(self, batch: int) -> None:
        """Compile (and on a GPU record) the decode steps of `batch` rows, at the trash row: short
        contexts and long."""
        inputs = torch.zeros((3, batch), dtype=torch.long, device=self.device)
        inputs[2] = self.trash_row
        for blocks in sorted({1, self.short_blocks + 1}) if self.pool is not None else (1,):
            self.decode_raw(inputs, blocks)

    def _decode(self, inputs, tiles, kv_blocks):
        return self._forward(decode_batch(inputs[0], inputs[1], inputs[2], tiles, kv_blocks))

    def decode_graph(self, batch: int, short: bool) -> tuple:
        """The CUDA graph of a decode step of `batch` rows whose sequences hold up to a short
        context of keys (`short`) or more, recorded on first use (warm-up)."""
        key = (batch, short and self.short_blocks > 0)
        if key not in self.graphs:
            static = torch.zeros((3, batch), dtype=torch.long, device=self.device)
            static[2] = self.trash_row  # recorded at the trash row: the eager runs write nothing real
            tiles = decode_tiles(batch, self.device)
            # the Triton kernel reads only this carrier's length: up to the short context, or past it
            blocks = torch.arange(self.short_blocks + (0 if key[1] else 1), device=self.device)
            graph, out = self._capture(self._decode, static, tiles, blocks)
            # every input stays referenced: the graph reads them at their recorded addresses
            self.graphs[key] = (graph, static, out, tiles, blocks)
        return self.graphs[key][:3]

    def _capture(self, fn, *inputs: torch.Tensor) -> tuple:
        """Record `fn(*inputs)` as a CUDA graph (as vLLM does per batch size) -> (graph, output),
        after running it eagerly twice on a side stream: that compiles, autotunes the Triton
        kernels and lets cuBLAS pick its workspaces outside the capture.  All graphs share one
        memory pool; they replay one at a time on one stream, and each replay overwrites the
        output of the last."""
        # one side stream for every capture: the caching allocator keeps a stream's freed blocks
        # for that stream alone, so a new stream per graph left each warm-up run's activations
        # held where nothing else could use them (an 8B model under the T4 profile ran out of
        # memory at warm-up with 1.6 GiB held that way)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*inputs)
        return graph, out


def _cpu_compile_options(device: torch.device) -> dict:
    """inductor's options on a CPU.  On a CPU whose vector ISA inductor picks as AVX2 (no AVX-512:
    many AMD EPYCs), torch 2.13's vectorized C++ for the dynamic-shape prompt graph gave garbage
    K/V (NaN logits) where the eager path and the scalar code agree (measured with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 Xeon); scalar code there.  GPUs: inductor's defaults."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": 1} if str(pick_vec_isa()) == "avx2" else {}
