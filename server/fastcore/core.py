"""FastCore: the engine object the server's `fast` engine plugs in, and the benches time.

    core = FastCore(model_dir_or_hf_model, max_slots=8, max_seq=2048, weight_quant="int8")
    slot = core.acquire()
    logits = core.step([(slot, prompt_ids), (other, [token]), ...])   # [2, vocab] float32
    core.release(slot)

A sequence lives in a slot (a row of the block table) and its K/V in blocks of a shared pool
(blocks.py): `step` appends each entry's tokens to its slot's sequence, in one forward for all of
them (a decoding slot brings one token, a prompt a chunk of any length), and returns the logits
at each entry's last token.  The pool is sized from the memory left after the weights, so slots
hold what their sequences really use, not a whole context each.  `pool.start(slot, prompt)`
shares the blocks of a cached prefix instead of computing them.

On a GPU every step replays a CUDA graph: decode-only steps one per batch bucket, steps with
prompt chunks one per token bucket, around a transformer block compiled once, with dynamic
shapes, for every layer (graphs.py); `warm_up()` compiles and records them all before a server
says it is ready.  `decode_greedy` launches a greedy decode step without waiting for it (the
scheduler's async scheduling).  On a CPU everything runs eagerly, the same code.

The parts: weights.py loads and builds the model, blocks.py keeps the pool, batch.py flattens a
step's entries, attention.py attends over the pages, graphs.py runs the compiled steps.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from quantserve.server.fastcore.attention import use_attention
from quantserve.server.fastcore.batch import build_batch
from quantserve.server.fastcore.blocks import BLOCK, BlockPool
from quantserve.server.fastcore.graphs import Steps
from quantserve.server.fastcore.model import ModelArgs
from quantserve.server.fastcore.quant import default_kernel, int4_tinygemm_supported, linear_weight_bytes
from quantserve.server.fastcore.weights import build_transformer, open_weights

PROMPT_PIECE = 2048  # tokens per forward when `prefill` is given a longer prompt at once


class KVPoolFull(RuntimeError):
    """A step needs more KV blocks than the pool has free (the scheduler reserves them first)."""


class PendingTokens:
    """Token ids a launched step is computing, copied to the host as soon as the GPU has them;
    `tolist()` waits for them."""

    def __init__(self, picks: torch.Tensor):
        self.host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=picks.is_cuda)
        self.host.copy_(picks, non_blocking=True)
        self.done = None
        if picks.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def tolist(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # the GIL is released while waiting
        return self.host.tolist()


class FastCore:
    def __init__(self, model, max_slots: int = 8, max_seq: int = 2048, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, weight_quant: str = "none",
                 compile: bool | None = None, quant_kernel: str = "auto", group_size: int = 128,
                 profile: str = "native", kv_blocks: int | None = None, kv_budget_gib: float | None = None,
                 random_config=None, seed: int = 0, attention: str = "auto", kv_cache_dtype: str = "auto",
                 prefix_cache: bool = True, max_batched_tokens: int = PROMPT_PIECE):
        """model: a checkpoint folder, a loaded HF model, or None with `random_config` (an HF
        config: random weights, for benchmarks).  max_slots: sequences at once; max_seq: the
        longest sequence.  kv_blocks: the pool's size in blocks of BLOCK positions; None sizes it
        from kv_budget_gib, or on a GPU from the memory left after the weights, or on a CPU as
        max_slots whole contexts.  attention: "triton", "torch" or "auto" (attention.py).
        kv_cache_dtype: "auto" (the model's dtype) or "int8" (a scale per head and position:
        about twice the tokens in the same memory).  max_batched_tokens: the most tokens one
        forward takes (the scheduler's budget; the pool leaves room for its activations)."""
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose auto or int8")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and device.index is None:  # memory queries need the index
            device = torch.device("cuda", torch.cuda.current_device())
        if dtype is None:
            dtype = torch.float16 if device.type == "cuda" else torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if quant_kernel == "auto":
            quant_kernel = default_kernel(device, weight_quant)
        if quant_kernel == "tinygemm" and not int4_tinygemm_supported(device, profile):
            raise ValueError("the tinygemm int4 kernel needs a CUDA GPU with compute capability >= 8.0 "
                             "(not a T4, not the T4 profile)")
        self.device, self.dtype, self.weight_quant, self.quant_kernel = device, dtype, weight_quant, quant_kernel
        self.max_slots, self.max_seq, self.max_batched_tokens = max_slots, max_seq, max(max_batched_tokens, PROMPT_PIECE)
        self.kv_int8 = kv_cache_dtype == "int8"
        self.start_up = {}  # seconds of each part of __init__ (/health shows them: loader.py)
        self.kernel_choices_loaded = 0  # weight-kernel choices warm_up took from files instead of timing them
        t0 = time.perf_counter()
        weights = open_weights(model, device, dtype, weight_quant, random_config, seed)
        self.prequantized = weights.prequantized  # an AWQ / GPTQ checkpoint's quantization (quant/prequantized.py)
        self.config = weights.config
        self.args = ModelArgs.from_hf(weights.config)
        self.groups = self.args.n_heads // self.args.n_kv_heads  # query heads per KV head
        self.model = build_transformer(weights, self.args, device, dtype, weight_quant, quant_kernel, group_size)
        self.attention = use_attention(self.model, attention, device)
        self.load_seconds = self.start_up["weights"] = time.perf_counter() - t0
        if device.type == "cuda":
            # the load's fp16 copies are freed but stay held by the caching allocator, in pieces
            # the sizes of the checkpoint's tensors: under a per-process cap (the T4 profile) they
            # count as used, and an allocation of another size cannot reuse them (an 8B model ran
            # out of memory at warm-up with 1 GiB held that way)
            torch.cuda.empty_cache()
        if kv_blocks is None:
            kv_blocks = self.blocks_for_budget(kv_budget_gib)
        t0 = time.perf_counter()
        self.pool = BlockPool(kv_blocks, max_slots, prefix_cache)
        self.model.setup_caches(kv_blocks, max_slots, max_seq, weights.rope, dtype, device,
                                torch.int8 if self.kv_int8 else None)
        self.compile = device.type == "cuda" if compile is None else compile
        graphs = self.compile and device.type == "cuda" and self.attention == "triton"
        self.steps = Steps(self.model, device, max_slots, self.compile, graphs, weight_quant, quant_kernel,
                           self.max_batched_tokens, self.groups)
        self.start_up["kv pool"] = time.perf_counter() - t0

    # ---- sizes ---------------------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read by one decode step: every linear layer, the norms, one embedding row."""
        m = self.model
        lin = sum(linear_weight_bytes(mod) for mod in m.modules()
                  if mod is not m.tok_embeddings and (hasattr(mod, "weight_bytes") or isinstance(mod, torch.nn.Linear)))
        norms = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "norm" in n)
        return lin + norms + self.args.dim * m.tok_embeddings.weight.element_size()

    def kv_bytes_per_token(self) -> int:
        return self.args.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8, self.kv_int8)

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.model.parameters()) + list(self.model.buffers()))

    def forward_reserve_bytes(self, tokens: int) -> int:
        """Memory a forward of `tokens` tokens needs at its peak beyond the weights and the cache,
        with a margin: 1 GiB (CUDA graphs, the allocator's slack, cuBLAS workspaces), Triton's
        timing buffer at warm-up (256 MB), the widest layer's activations, and a dense fp16 copy
        of the largest weight (prompt-sized int8/int4 matmuls may dequantize it for cuBLAS,
        triton_mm.py).  An 8B model in int8 ran out of memory under the T4 profile with a flat
        1 GiB: its gate-up weight alone is 224 MiB in fp16."""
        a, b = self.args, torch.finfo(self.dtype).bits // 8
        qkv = (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
        widest = tokens * (a.dim * 3 + qkv + 3 * a.ffn_dim) * b  # residual, norms, qkv, gate-up, act
        largest = max(2 * a.ffn_dim * a.dim, qkv * a.dim, a.vocab_size * a.dim) * b
        return 2**30 + 256 * 10**6 + widest + largest

    def blocks_for_budget(self, budget_gib: float | None = None, reserve_gib: float | None = None) -> int:
        """How many KV blocks fit in the memory left (minus a reserve for activations and the
        graphs: forward_reserve_bytes); at most two whole contexts per slot (the rest would only
        hold cached prefixes)."""
        if reserve_gib is None:
            reserve_gib = self.forward_reserve_bytes(self.max_batched_tokens) / 2**30
        per_seq = -(-self.max_seq // BLOCK)
        if budget_gib is None and self.device.type != "cuda":
            return self.max_slots * per_seq
        if budget_gib is None:
            free, _ = torch.cuda.mem_get_info(self.device)
            # respect a per-process cap (the T4 profile) as well as what the device has free
            cap = torch.cuda.get_per_process_memory_fraction(self.device) * torch.cuda.get_device_properties(self.device).total_memory \
                if hasattr(torch.cuda, "get_per_process_memory_fraction") else free
            budget_gib = min(free, cap - torch.cuda.memory_reserved(self.device)) / 2**30
        per_block = BLOCK * self.kv_bytes_per_token() / 2**30
        return max(1, min(2 * self.max_slots * per_seq, int((budget_gib - reserve_gib) / per_block)))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def kv_usage(self) -> float:
        """Fraction of the pool's blocks that live sequences hold."""
        return self.pool.used_blocks() / self.pool.num_blocks

    # ---- slots ---------------------------------------------------------------------------------
    def acquire(self) -> int:
        """The lowest free slot, holding an empty sequence."""
        if all(self.pool.live):
            raise RuntimeError("no free slot")
        slot = self.pool.live.index(False)
        self.pool.start(slot, [])
        return slot

    def release(self, slot: int) -> None:
        """The slot's sequence is over; its full blocks stay cached for later prompts."""
        self.pool.release(slot)

    # ---- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Append each (slot, ids) entry's tokens to its slot's sequence, all in one forward, and
        return the logits at each entry's last token: [len(items), vocab] float32 on the device."""
        entries = self._reserve(items)
        if all(len(ids) == 1 for _, ids, _ in entries):
            kv_blocks = -(-max(start + 1 for _, _, start in entries) // BLOCK)
            logits = self.steps.decode(entries, kv_blocks)
        else:
            logits = self.steps.run_mixed(entries)
        for slot, ids, _ in entries:
            self.pool.written(slot, list(ids))
        return logits.float()

    @torch.inference_mode()
    def decode_greedy(self, rows: list[int], positions: list[int], tokens) -> tuple[torch.Tensor, "PendingTokens"]:
        """Launch one decode step without waiting for it: row i is fed tokens[i] at positions[i]
        (`tokens` a host list, or a device tensor: the previous step's picks, which never come to
        the host first).  Returns each row's greedy next token as a device tensor, and the same
        on their way to the host (PendingTokens).  The pool's record of the fed tokens is the
        caller's (`pool.written`), once it knows them: the scheduler launches step k + 1 before
        it has read step k's tokens (paged_scheduler.py)."""
        for row, pos in zip(rows, positions):
            self._make_room(row, pos, 1)
        self.sync_table()
        inputs = self.steps.decode_inputs(rows, positions, tokens)
        picks = self.steps.decode_raw(inputs, -(-(max(positions) + 1) // BLOCK))[:len(rows)].argmax(-1)
        return picks, PendingTokens(picks)

    def _reserve(self, items) -> list[tuple[int, list[int], int]]:
        """(slot, ids, first position) per item, with blocks for them; the device's block table
        brought up to date."""
        entries = []
        for slot, ids in items:
            ids = [int(t) for t in (ids.tolist() if torch.is_tensor(ids) else ids)]
            start = self.pool.held(slot)
            self._make_room(slot, start, len(ids))
            entries.append((slot, ids, start))
        self.sync_table()
        return entries

    def _make_room(self, slot: int, start: int, n: int) -> None:
        """Blocks for n tokens of `slot` at positions start..; the step's inputs checked first."""
        if not n or start + n > self.max_seq:
            raise ValueError(f"{n} tokens at position {start} do not fit max_seq {self.max_seq}")
        if not self.pool.reserve(slot, start + n):
            raise KVPoolFull(f"{n} more tokens for slot {slot}: {self.pool.free_blocks()} of "
                             f"{self.pool.num_blocks} KV blocks free")

    def sync_table(self) -> None:
        """Copy the block-table rows that changed to the device (in place: graphs read that buffer)."""
        if not self.pool.dirty:
            return
        rows = sorted(self.pool.dirty)
        width = self.model.block_table.shape[1]
        # built in numpy: a torch.tensor per row cost ~10 us each (350 us for 32 rows on the CI
        # CPU, against 70 us), on the scheduler thread of every step whose sequences took a block
        host = np.full((len(rows), width), self.pool.num_blocks, dtype=np.int32)  # the trash block
        for i, r in enumerate(rows):
            blocks = self.pool.table[r]
            host[i, :len(blocks)] = blocks
        host = torch.from_numpy(host)
        # non-blocking copies (staged by the driver; no wait for the GPU): a blocking one waited
        # for the step in flight, which with async scheduling happened whenever a sequence
        # crossed into a new block (a quarter of the scheduler's time at 32 sequences, py-spy)
        index = torch.tensor(rows).to(self.device, non_blocking=True)
        self.model.block_table[index] = host.to(self.device, non_blocking=True)
        self.pool.dirty.clear()

    # ---- conveniences over `step` --------------------------------------------------------------
    def prefill(self, slot: int, ids, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Write `ids` into `slot` at positions start.. (start 0: a fresh sequence, nothing taken
        from the prefix cache) and return the last position's logits ([vocab]), or with all_logits
        every position's ([n, vocab]: prompt log-probabilities)."""
        ids = [int(t) for t in (ids.tolist() if torch.is_tensor(ids) else ids)]
        if start == 0:
            self.pool.start(slot, [])
        elif start != self.pool.held(slot):
            raise ValueError(f"slot {slot} holds {self.pool.held(slot)} positions: cannot write at {start}")
        rows = []
        for c0 in range(0, len(ids), PROMPT_PIECE):
            piece = ids[c0:c0 + PROMPT_PIECE]
            rows.append(self._every_position(slot, piece) if all_logits else self.step([(slot, piece)])[0])
        return torch.cat(rows) if all_logits else rows[-1]

    def decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """One token for each of `slots` -> logits [len(slots), vocab] float32."""
        return self.step([(s, [int(t)]) for s, t in zip(slots, tokens)])

    @torch.inference_mode()
    def embed(self, slot: int, ids: list[int], pooling: str) -> torch.Tensor:
        """Write `ids` into `slot` from position 0 and return the final hidden state pooled over
        them: the last token's ("last") or the mean of all ("mean")."""
        self.pool.start(slot, [])
        total, last = None, None
        for c0 in range(0, len(ids), PROMPT_PIECE):
            h = self._every_position(slot, ids[c0:c0 + PROMPT_PIECE], hidden=True)
            total = h.sum(0) if total is None else total + h.sum(0)
            last = h[-1]
        return (total / len(ids) if pooling == "mean" else last).cpu()

    @torch.inference_mode()
    def _every_position(self, slot: int, ids: list[int], hidden: bool = False) -> torch.Tensor:
        """One eager forward of `ids` into `slot` with every position's output ([n, vocab] logits
        or [n, dim] hidden states): scoring and embeddings, which the compiled steps do not give."""
        entries = self._reserve([(slot, ids)])
        out = self.model(build_batch(entries, self.device, self.groups), all_positions=True, hidden=hidden).float()
        self.pool.written(slot, ids)
        return out

    # ---- warm-up -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, progress: bool = False, max_tokens: int = PROMPT_PIECE, choices_file=None,
                kernel_table=None) -> float:
        """Compile and record, now, what a server's requests would otherwise wait for: the CUDA
        graph of every decode batch bucket, the compiled mixed forward, and the weight kernels'
        tiles for every size of forward up to `max_tokens` tokens (they are chosen per power-of-two
        size).  choices_file: where the Triton weight kernels' choices are kept between starts
        (compile_cache.py's folder); kernel_table: the choices shipped for this GPU model
        (kernel_tables.py), taken for the shapes the file lacks.  Returns the seconds it took (the
        bars on stderr say how far)."""
        from quantserve.progress import track
        from quantserve.server.fastcore.quant import triton_layers, triton_ops

        t0 = time.perf_counter()
        kernels = triton_ops() if self.weight_quant != "none" and self.quant_kernel == "triton" else None
        if kernels is not None:
            from quantserve.server.fastcore import kernel_choices

            self.kernel_choices_loaded = kernel_choices.load_choices(choices_file, kernel_table)
            kernel_choices.compile_chosen(triton_layers(self.model))
        for batch in track(self.steps.buckets if self.compile else (), "compiling decode steps (batch sizes)",
                           "size", enabled=progress):
            self.steps.warm_decode(batch)
        try:
            self._warm_up_mixed(max_tokens, progress)
        except Exception as e:  # eager steps still serve: say so, once
            if not self.compile:
                raise
            print(f"warning: the compiled forward failed ({type(e).__name__}: {str(e)[:200]}); "
                  "prompts run eagerly", file=sys.stderr)
            self.steps.compile_mixed = False
            self._warm_up_mixed(max_tokens, progress)
        sizes = self.steps.token_buckets if self.steps.mixed_graphs and self.steps.compile_mixed else ()
        try:
            for tokens in track(sizes, "recording prompt steps (tokens per forward)", "size", enabled=progress):
                self.steps.mixed_graph(tokens)
        except Exception as e:  # the compiled forward still serves prompts, launched from Python
            print(f"warning: recording a prompt step as a CUDA graph failed ({type(e).__name__}: "
                  f"{str(e)[:200]}); prompt steps run without graphs", file=sys.stderr)
            self.steps.mixed_graphs = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if kernels is not None and choices_file is not None:
            try:
                kernel_choices.save_choices(choices_file)
            except OSError as e:  # a read-only cache: the next start tunes again, nothing worse
                print(f"warning: could not keep the weight kernels' choices in {choices_file}: {e}", file=sys.stderr)
        return time.perf_counter() - t0

    def _warm_up_mixed(self, max_tokens: int, progress: bool) -> None:
        """Mixed steps of one sequence and of several (a size of 1 compiles a graph of its own),
        then one of each power-of-two size of forward up to max_tokens.  The slots and blocks
        are given back after, and nothing they computed stays cached."""
        from quantserve.progress import track

        slots = [self.acquire() for _ in range(min(3, self.max_slots))]
        widths = [w for w in (64, 128, 256, 512, 1024, 2048, 4096, 8192) if w < max_tokens] + [max_tokens]
        try:
            self.step([(slots[0], [0] * 16)])
            if len(slots) > 1:
                self.step([(slots[0], [0]), (slots[1], [0] * 8)] + [(s, [0] * 5) for s in slots[2:]])
            for width in track(widths, "tuning the weight kernels (tokens per forward)", "size", enabled=progress):
                pieces = [min(self.max_seq, width - i * self.max_seq) for i in range(len(slots))]
                pieces = [n for n in pieces if n > 0]
                if sum(pieces) < width or sum(self.pool.blocks_for(n) for n in pieces) > self.pool.num_blocks:
                    break  # more than the slots or the pool hold: no forward that large ever runs
                for s in slots:
                    self.pool.start(s, [])  # from position 0 again, the blocks back in the pool
                if self.device.type == "cuda":
                    # the last size's activations and tuning buffers, freed, would stay held in
                    # pieces of their own sizes (see __init__): given back before this one
                    torch.cuda.empty_cache()
                self.step([(s, [0] * n) for s, n in zip(slots, pieces)])
        finally:
            for s in slots:
                self.release(s)
            self.pool.forget_all()  # the warm-up's tokens are no prefix anyone asked for


__all__ = ["FastCore", "KVPoolFull", "PendingTokens"]
