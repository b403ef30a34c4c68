"""FastCore's forward steps, compiled (torch.compile) and on a GPU replayed from CUDA graphs.

Two steps run the model (model.py):

    decode   one token for each cache row 0..P-1, each at its own position
    prefill  one prompt chunk into one row, or short pieces into several rows (prefill_many)

Launched from Python, a step's ~10 (decode) or ~25 (prompt) kernels per layer take several times
the GPU's own time, so on a GPU each step is compiled and recorded as a CUDA graph that replays
in one launch.  A graph has fixed shapes, so every step is padded to one of a few: the batch to
the next size in BATCH_BUCKETS, the attended cache prefix to the next multiple of `kv_bucket`,
a prompt chunk to the next of `prefill_widths()`.  Padding rows and positions write the cache's
trash row.  FastCore.warm_up records every shape at start-up, so no request waits on a compile.
"""

from __future__ import annotations

import bisect

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KV_BUCKET = 256


def prefill_inputs(slot: int, chunk: torch.Tensor, start: int, width: int, max_seq: int) -> list[torch.Tensor]:
    """Host tensors (tokens, positions, cache row, index of the last token) for one prompt chunk
    padded to `width` tokens; padding sits at the trash position, which no prompt attends to."""
    n = chunk.numel()
    tok = torch.zeros((1, width), dtype=torch.long)
    pos = torch.full((1, width), max_seq, dtype=torch.long)
    tok[0, :n], pos[0, :n] = chunk, torch.arange(start, start + n)
    return [tok, pos, torch.tensor([slot]), torch.tensor([max(n - 1, 0)])]


class Steps:
    """The compiled steps of one model and cache, and the CUDA graphs recorded for them."""

    def __init__(self, model, device: torch.device, max_slots: int, max_seq: int, prefill_chunk: int,
                 compile: bool, weight_quant: str, quant_kernel: str):
        self.model, self.device, self.max_seq, self.prefill_chunk = model, device, max_seq, prefill_chunk
        self.compile, self.weight_quant, self.quant_kernel = compile, weight_quant, quant_kernel
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        # at most 8 attended lengths: each (batch, length) pair is one CUDA graph to record
        self.kv_bucket = max(KV_BUCKET, -(-max_seq // (8 * KV_BUCKET)) * KV_BUCKET)
        self._fns: dict[str, object] = {}
        # (batch, KV length) or ("prefill", width, KV length) -> the CUDA graph and the tensors it
        # reads and writes; CUDA + compile only
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if compile and device.type == "cuda" else None

    # ---- shapes --------------------------------------------------------------------------------
    def padded_batch(self, n: int) -> int:
        """The batch bucket that covers rows 0..n-1."""
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def kv_len(self, n: int) -> int:
        """The attended cache prefix for a sequence of n positions."""
        return min(self.max_seq, -(-n // self.kv_bucket) * self.kv_bucket)

    def kv_lengths(self) -> list[int]:
        """Every attended KV length a step can run at (multiples of `kv_bucket`, and max_seq)."""
        return sorted({self.kv_len(n) for n in range(1, self.max_seq + 1, self.kv_bucket)} | {self.max_seq})

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every (padded batch, attended KV length) a decode step can run at."""
        return [(b, n) for b in self.buckets for n in self.kv_lengths()]

    def prefill_widths(self) -> list[int]:
        """The padded chunk lengths a prompt chunk runs at on a GPU (one CUDA graph per width and
        attended length): 16, 32, 64, then four per octave from 128 (128, 160, 192, 224, 256,
        320, ...: at most 25 % padding), up to the chunk size."""
        cap, widths, w = min(self.prefill_chunk, self.max_seq), [], 16
        while w < cap:
            widths += [w] if w < 128 else [w, w * 5 // 4, w * 3 // 2, w * 7 // 4]
            w *= 2
        return [x for x in widths if x < cap] + [cap]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (padded chunk width, attended KV length) a prompt chunk can run at."""
        shapes, shortest = [], 1
        for w in self.prefill_widths():
            shapes += [(w, n) for n in self.kv_lengths() if n >= self.kv_len(shortest)]
            shortest = w + 1
        return shapes

    # ---- decode --------------------------------------------------------------------------------
    def decode_step(self, batch: int):
        """The decode forward for one padded batch size: compiled (dynamic sizes) when `compile`."""
        key = "b1" if batch == 1 else "bN"
        if key not in self._fns:
            # two functions, not one: dynamo keeps compiled code per Python code object
            fn = self._decode_b1 if batch == 1 else self._decode_bn
            if self.compile:
                # gpt-fast's setting: coordinate-descent tuning makes inductor turn 1-row matmuls
                # into fused reductions (int8/int4 dequant folded in).  With the Triton int8/int4
                # kernels no weight matmul is left for it to fuse, and the tuning costs minutes of
                # compile on an 8B model.
                # No inductor CUDA graphs: without cudagraph trees inductor specializes every
                # symbolic size (torch/_inductor/output_code.py, "Force specialize all inputs"), a
                # compile per (batch, KV length) that took minutes and hit dynamo's recompile limit,
                # and trees assert when the server's scheduler thread replays a graph recorded on
                # another thread (pytorch#123177).  `decode_padded` captures its own graphs instead.
                fuse = batch == 1 and (self.weight_quant == "none" or self.quant_kernel not in ("triton", "gemlite"))
                # should a size still be specialized somewhere, one compile per shape beats failing;
                # dynamo counts compiles per code object, so every FastCore in a process adds its own
                torch._dynamo.config.recompile_limit += len(self.decode_shapes()) + 2
                fn = torch.compile(fn, fullgraph=True, options={"coordinate_descent_tuning": fuse})
            self._fns[key] = fn
        return self._fns[key]

    def _decode_b1(self, tokens, pos, kv_idx):
        return self.model(tokens.view(-1, 1), pos.view(-1, 1), 0, kv_idx)[:, 0]

    def _decode_bn(self, tokens, pos, kv_idx):
        return self.model(tokens.view(-1, 1), pos.view(-1, 1), 0, kv_idx)[:, 0]

    def decode_padded(self, tok: torch.Tensor, pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The raw step on device tensors of a bucket size (no host sync: benchmarks loop on it).
        Returns the logits in the step's own output buffer: copy before the next call."""
        fn = self.decode_step(tok.shape[0])
        if self.pool is None:
            return fn(*self._mark_dynamic(tok, pos, kv_idx))
        key = (tok.shape[0], kv_idx.shape[0])
        if key not in self.graphs:
            static_tok, static_pos, static_kv = self._mark_dynamic(tok.clone(), pos.clone(), kv_idx)
            self.graphs[key] = (*self._capture(fn, static_tok, static_pos, static_kv), static_tok, static_pos, static_kv)
        graph, out, static_tok, static_pos, _ = self.graphs[key]
        static_tok.copy_(tok)
        static_pos.copy_(pos)
        graph.replay()  # the whole step, ~10 kernels per layer, in one launch
        return out

    def _mark_dynamic(self, tok, pos, kv_idx):
        """One compiled graph for every attended length (and every batch size > 1); batch 1 stays
        static so its matmuls become reductions."""
        if self.compile:
            torch._dynamo.maybe_mark_dynamic(kv_idx, 0)
            if tok.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(tok, 0)
                torch._dynamo.maybe_mark_dynamic(pos, 0)
        return tok, pos, kv_idx

    # ---- prompts -------------------------------------------------------------------------------
    def prefill_step(self):
        """The prompt forward, compiled once for every prompt length, KV length and slot (the slot
        goes in as a tensor).  Eager, a prompt's ~20 small ops per layer cost more Python than GPU
        time: under load the server spent most of its time there (bench/RESULTS.md)."""
        if "prefill" not in self._fns:
            torch._dynamo.config.recompile_limit += 2
            compiled = torch.compile(self._prefill_forward, fullgraph=True, dynamic=True,
                                     options=_cpu_compile_options(self.device))

            def step(*inputs):
                # no "duck sizing": a prompt as long as its KV prefix must not tie the two sizes
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(*inputs)
            self._fns["prefill"] = step
        return self._fns["prefill"]

    def _prefill_forward(self, tok, pos, rows, last, kv_idx):
        return self.model(tok, pos, rows, kv_idx, last=last)

    def prefill_replay(self, slot: int, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """A prompt chunk as one CUDA-graph replay: launching the compiled graph's ~25 kernels per
        layer from Python took several times the GPU's own time for a prompt (bench/RESULTS.md)."""
        n = chunk.numel()
        width = next(w for w in self.prefill_widths() if w >= n)
        graph, static, _, out = self.prefill_graph(width, self.kv_len(start + n))
        for dst, src in zip(static, prefill_inputs(slot, chunk, start, width, self.max_seq)):
            dst.copy_(src)
        graph.replay()
        return out[0, -1].float().clone()  # the graph's own buffer: the next replay overwrites it

    def prefill_graph(self, width: int, length: int) -> tuple:
        key = ("prefill", width, length)
        if key not in self.graphs:
            # record at the trash position only: the eager runs before the capture write nothing real
            empty = torch.zeros(0, dtype=torch.long)
            static = [t.to(self.device) for t in prefill_inputs(0, empty, 0, width, self.max_seq)]
            kv_idx = torch.arange(length, device=self.device)
            graph, out = self._capture(self.prefill_step(), *static, kv_idx)
            # every input stays referenced: the graph reads them at their recorded addresses, and
            # a freed one is soon someone else's memory (garbage attention masks, measured)
            self.graphs[key] = (graph, static, kv_idx, out)
        return self.graphs[key]

    def _capture(self, fn, *inputs: torch.Tensor) -> tuple:
        """Record `fn(*inputs)` as a CUDA graph (as vLLM does per batch size) -> (graph, output),
        after running it eagerly twice on a side stream: that compiles, autotunes the Triton
        kernels and lets cuBLAS pick its workspaces outside the capture.  The eager runs write the
        same K/V rows the graph itself writes.  All graphs share one memory pool; they replay one at
        a time on one stream, and each replay overwrites the output of the last."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*inputs)
        return graph, out


def use_decode_attention(model, choice: str, device: torch.device) -> str:
    """The decode step's attention kernel: "triton" (split-KV, triton_attention.py) or "sdpa";
    "auto" picks triton on a CUDA GPU with Triton.  Triton's is set on the layers it can serve."""
    if choice not in ("auto", "triton", "sdpa"):
        raise ValueError(f"unknown attention {choice!r} (auto, triton or sdpa)")
    if choice == "auto":
        from quantserve.server.fastcore.quant import triton_ops

        choice = "triton" if device.type == "cuda" and triton_ops() is not None else "sdpa"
    if choice == "triton" and device.type != "cuda":
        raise ValueError("the Triton decode attention runs on a CUDA GPU only")
    if choice == "triton":
        from quantserve.server.fastcore.triton_attention import decode_attention

        a = model.a
        for layer in model.layers:
            # the kernel knows neither soft-capping nor another scale (nor a window: forward checks)
            if not (a.attn_softcap or a.attn_scale):
                layer.attention.decode_kernel = decode_attention
    return choice


def _cpu_compile_options(device: torch.device) -> dict:
    """inductor's options for the dynamic-shape prompt graph.  On a CPU whose vector ISA inductor
    picks as AVX2 (no AVX-512: many AMD EPYCs), torch 2.13's vectorized C++ for this graph gave
    garbage K/V (NaN logits) where the eager path and the scalar code agree (measured with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 Xeon); scalar code there.  GPUs: inductor's defaults."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": 1} if str(pick_vec_isa()) == "avx2" else {}
