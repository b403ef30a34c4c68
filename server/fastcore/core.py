"""FastCore: the decode engine object the server's `fast` engine plugs in, and bench/decode.py times.

    core = FastCore(model_dir_or_hf_model, max_slots=8, max_seq=2048, weight_quant="int8")
    slot = core.acquire()
    logits = core.prefill(slot, prompt_ids)                 # [vocab] float32, last position
    logits = core.decode([slot, ...], [tok, ...], [pos, ...])  # [n, vocab] float32
    core.release(slot)

`decode` runs any subset of slots at their own positions.  It pads the batch to the next size in
BATCH_BUCKETS covering slots 0..max(slot) (slots are handed out lowest-first, so the active set
stays compact) and the attended cache prefix to the next multiple of `kv_bucket`, so on a GPU each
(batch, kv-length) pair replays one CUDA graph; `warm_up()` records them all at start-up.
Padding rows write into the cache's trash row.

`prefill(slot, ids, start)` appends `ids` at position `start`; a scheduler that wants running
decodes not to stall calls it with chunks (`prefill_chunk` tokens) between decode steps.  A chunk
runs through one compiled graph whatever its length; on a GPU it is padded to the next of a few
widths (padding writes the trash row) and replays that width's CUDA graph, recorded at warm-up too.

The parts: weights.py loads and builds the model, graphs.py runs its compiled steps and CUDA
graphs, slots.py records which slots are live and how long each sequence is.  This class ties
them together.
"""

from __future__ import annotations

import sys
import time

import torch

from quantserve.server.config import EngineOptions
from quantserve.server.fastcore.graphs import BATCH_BUCKETS, Steps, prefill_inputs, use_decode_attention
from quantserve.server.fastcore.model import ModelArgs
from quantserve.server.fastcore.quant import default_kernel, int4_tinygemm_supported, linear_weight_bytes
from quantserve.server.fastcore.slots import SlotTable
from quantserve.server.fastcore.weights import build_transformer, open_weights


class FastCore:
    def __init__(self, model, max_slots: int | None = 8, max_seq: int = 2048, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, weight_quant: str = "none",
                 compile: bool | None = None, quant_kernel: str = "auto", group_size: int = 128,
                 prefill_chunk: int = EngineOptions.prefill_chunk, profile: str = "native", kv_budget_gib: float | None = None,
                 random_config=None, seed: int = 0, attention: str = "auto", kv_cache_dtype: str = "auto"):
        """model: a checkpoint folder, a loaded HF LlamaForCausalLM, or None with `random_config`
        (an HF config: random weights, for benchmarks).  max_slots=None sizes the KV cache from the
        GPU memory left after the weights (or from kv_budget_gib).  attention: the decode step's
        kernel, "triton" (split-KV, triton_attention.py), "sdpa", or "auto" (triton on a GPU).
        kv_cache_dtype: "auto" (the model's dtype) or "int8" (a scale per head and position: twice
        the sequences in the same memory; its attention runs through SDPA)."""
        if kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: choose auto or int8")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float16 if device.type == "cuda" else torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if quant_kernel == "auto":
            quant_kernel = default_kernel(device, weight_quant)
        if quant_kernel == "tinygemm" and not int4_tinygemm_supported(device, profile):
            raise ValueError("the tinygemm int4 kernel needs a CUDA GPU with compute capability >= 8.0 "
                             "(not a T4, not the T4 profile)")
        self.device, self.dtype, self.weight_quant, self.quant_kernel = device, dtype, weight_quant, quant_kernel
        self.prefill_chunk, self.max_seq = prefill_chunk, max_seq
        self.kv_int8 = kv_cache_dtype == "int8"
        t0 = time.perf_counter()
        weights = open_weights(model, device, dtype, weight_quant, random_config, seed)
        self.prequantized = weights.prequantized  # an AWQ / GPTQ checkpoint's quantization (quant/prequantized.py)
        self.config = weights.config
        self.args = ModelArgs.from_hf(weights.config)
        self.model = build_transformer(weights, self.args, device, dtype, weight_quant, quant_kernel, group_size)
        self.attention = use_decode_attention(self.model, attention, device)
        self.load_seconds = time.perf_counter() - t0
        if max_slots is None:
            max_slots = self.slots_for_budget(kv_budget_gib)
        self.max_slots = max_slots
        self.model.setup_caches(max_slots, max_seq, weights.rope, dtype, device,
                                torch.int8 if self.kv_int8 else None)
        self.slots = SlotTable(max_slots)
        self.compile = device.type == "cuda" if compile is None else compile
        self.compile_prefill = self.compile
        self.compile_prefill_many = True  # prefill_many through the compiled prompt graph (see warm_up)
        self.steps = Steps(self.model, device, max_slots, max_seq, prefill_chunk, self.compile,
                           weight_quant, quant_kernel)
        self._kv_idx = torch.arange(max_seq, device=device)

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

    def slots_for_budget(self, budget_gib: float | None = None, reserve_gib: float = 1.0) -> int:
        """How many max_seq-long sequences fit in the memory left (minus a reserve for activations)."""
        if budget_gib is None:
            if self.device.type != "cuda":
                return 8
            free, _ = torch.cuda.mem_get_info(self.device)
            # respect a per-process cap (the T4 profile) as well as what the device has free
            cap = torch.cuda.get_per_process_memory_fraction(self.device) * torch.cuda.get_device_properties(self.device).total_memory \
                if hasattr(torch.cuda, "get_per_process_memory_fraction") else free
            budget = min(free, cap - torch.cuda.memory_allocated(self.device)) / 2**30
        else:
            budget = budget_gib
        per_slot = (self.max_seq + 1) * self.kv_bytes_per_token() / 2**30
        return max(1, min(BATCH_BUCKETS[-1], int((budget - reserve_gib) / per_slot)))

    # ---- slots ---------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return self.slots.free()

    def acquire(self) -> int:
        """The lowest free slot (keeps active slots compact, so decode batches stay small)."""
        return self.slots.acquire()

    def release(self, slot: int) -> None:
        """The slot's sequence is over (its K/V stay where they are: a prefix cache may copy them)."""
        self.slots.release(slot)

    def occupy(self, slot: int, length: int) -> None:
        """`slot` holds a live sequence whose first `length` positions are already in the cache."""
        self.slots.occupy(slot, length)

    @torch.inference_mode()
    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """dst's first n cache positions := src's (prefix caching: a copy instead of a prompt
        forward).  In place, so the captured CUDA graphs keep reading the same buffers."""
        for layer in self.model.layers:
            att = layer.attention
            for cache in (att.k_cache, att.v_cache, att.k_scale, att.v_scale):
                if cache is not None:  # the scales exist with an int8 cache only
                    cache[dst, :, :n].copy_(cache[src, :, :n])
        if self.slots.in_use[dst]:
            self.slots.occupy(dst, n)

    def kv_usage(self) -> float:
        """Fraction of the KV cache's token positions holding live tokens."""
        return self.slots.held_tokens() / (self.max_slots * self.max_seq)

    # ---- shapes (graphs.py) --------------------------------------------------------------------
    def kv_lengths(self) -> list[int]:
        """Every attended KV length a step can run at (multiples of `kv_bucket`, and max_seq)."""
        return self.steps.kv_lengths()

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every (padded batch, attended KV length) a decode step can run at."""
        return self.steps.decode_shapes()

    def prefill_widths(self) -> list[int]:
        """The padded chunk lengths a prompt chunk runs at on a GPU (graphs.Steps.prefill_widths)."""
        return self.steps.prefill_widths()

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (padded chunk width, attended KV length) a prompt chunk can run at."""
        return self.steps.prefill_shapes()

    @property
    def _graphs(self) -> dict:
        """The CUDA graphs recorded so far, by shape."""
        return self.steps.graphs

    # ---- warm-up -------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, progress: bool = False) -> float:
        """Compile and record every decode shape a server can hit (each batch bucket x each attended
        length) and every prompt shape now, so that no request waits on torch.compile, Triton
        autotuning or a CUDA-graph recording later.  Returns the seconds it took (the bars on stderr
        say how far it is)."""
        from quantserve.progress import track

        t0 = time.perf_counter()
        shapes = self.decode_shapes()
        for batch, length in track(shapes, "compiling decode shapes (batch x KV length)", "shape", enabled=progress):
            tok = torch.zeros(batch, dtype=torch.long, device=self.device)
            pos = torch.full((batch,), self.max_seq, dtype=torch.long, device=self.device)  # the trash row
            self.decode_padded(tok, pos, self._kv_idx[:length])
        try:
            self._warm_up_prompts(progress)
        except Exception as e:  # eager prompts still serve: say so, once
            if not self.compile_prefill:
                raise
            print(f"warning: the compiled prompt path failed ({type(e).__name__}: {str(e)[:200]}); "
                  "prompts run eagerly", file=sys.stderr)
            self.compile_prefill = False
            self._warm_up_prompts(progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _warm_up_prompts(self, progress: bool) -> None:
        """Compile the prompt graph, let the weight kernels pick their prompt-sized path, and on a
        GPU record every (chunk width, KV length) prompt graph."""
        from quantserve.progress import track

        if self.compile_prefill and self.steps.pool is not None:
            shapes = self.prefill_shapes()
            for width, length in track(shapes, "recording prompt shapes (width x KV length)", "shape",
                                       enabled=progress):
                self.steps.prefill_graph(width, length)
        else:  # one full chunk (slot 0 is reset afterwards)
            self.prefill(0, torch.zeros(min(self.prefill_chunk, self.max_seq), dtype=torch.long))
            self.release(0)
        if self.compile_prefill and self.max_slots > 2:
            # the batched form of the prompt forward (prefill_many): compiled now, not on the first
            # request that needs it; its batch size is dynamic from the second size on.  Should it
            # fail to compile, it runs eagerly (still one pass over the weights for all pieces).
            try:
                for batch in (2, 3):
                    self.prefill_many([(s, [0] * 16, 0) for s in range(batch)])
            except Exception as e:
                print(f"warning: the compiled batched prompt path failed ({type(e).__name__}: {str(e)[:200]}); "
                      "batched prompt pieces run eagerly", file=sys.stderr)
                self.compile_prefill_many = False
            for s in range(3):
                self.release(s)

    # ---- prompts -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, ids, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Write `ids` into `slot` at positions start.. and return the last position's logits
        ([vocab]), or with all_logits every position's ([n, vocab]: prompt log-probabilities;
        eager, as scoring is not what the compiled graphs are recorded for)."""
        ids = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids, dtype=torch.long).view(-1).cpu()
        n = ids.numel()
        if n == 0 or start + n > self.max_seq:
            raise ValueError(f"prefill of {n} tokens at {start} does not fit max_seq {self.max_seq}")
        rows = []
        for c0 in range(0, n, self.prefill_chunk):
            chunk, at = ids[c0:c0 + self.prefill_chunk], start + c0
            if all_logits:
                rows.append(self._eager_chunk(slot, chunk, at))
            else:
                logits = self._prefill_chunk(slot, chunk, at)
        self.slots.occupy(slot, start + n)
        return torch.cat(rows) if all_logits else logits

    @torch.inference_mode()
    def embed(self, slot: int, ids: list[int], pooling: str) -> torch.Tensor:
        """Write `ids` into `slot` from position 0 (eagerly, in chunks) and return the final hidden
        state pooled over the prompt: the last token's ("last") or the mean of all ("mean")."""
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        if not 0 < ids_t.numel() <= self.max_seq:
            raise ValueError(f"an embedding input of {ids_t.numel()} tokens does not fit max_seq {self.max_seq}")
        total, last = None, None
        for c0 in range(0, ids_t.numel(), self.prefill_chunk):
            h = self._eager_chunk(slot, ids_t[c0:c0 + self.prefill_chunk], c0, hidden=True)
            total = h.sum(0) if total is None else total + h.sum(0)
            last = h[-1]
        self.slots.occupy(slot, ids_t.numel())
        return (total / ids_t.numel() if pooling == "mean" else last).cpu()

    def _eager_chunk(self, slot: int, chunk: torch.Tensor, start: int, hidden: bool = False) -> torch.Tensor:
        """One prompt chunk at positions start.., eagerly, with every position's output ([n, vocab]
        logits, or [n, dim] final hidden states): scoring and embeddings, which the compiled
        graphs (last position only) do not give."""
        kv_idx = torch.arange(self.steps.kv_len(start + chunk.numel()), device=self.device)
        tok, pos = (t.to(self.device) for t in prefill_inputs(slot, chunk, start, chunk.numel(), self.max_seq)[:2])
        return self.model(tok, pos, slot, kv_idx, hidden=hidden)[0].float()

    @torch.inference_mode()
    def prefill_many(self, items: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Several short prompt pieces, (slot, ids, start) each, in one forward: one pass over the
        weights instead of one per piece (what 32 users of one cached system prompt need: only
        their questions are left to compute).  Pieces are padded to the longest (padding writes
        the trash row).  Returns the last real position's logits, [len(items), vocab] float32."""
        width = max(len(ids) for _, ids, _ in items)
        if width > self.prefill_chunk or any(start + len(ids) > self.max_seq for _, ids, start in items):
            raise ValueError(f"prefill_many pieces must fit the chunk ({self.prefill_chunk}) and max_seq")
        B = len(items)
        tok = torch.zeros((B, width), dtype=torch.long)
        pos = torch.full((B, width), self.max_seq, dtype=torch.long)
        for i, (_, ids, start) in enumerate(items):
            tok[i, :len(ids)] = torch.as_tensor(ids, dtype=torch.long)
            pos[i, :len(ids)] = torch.arange(start, start + len(ids))
        rows = torch.tensor([slot for slot, _, _ in items])
        last = torch.tensor([len(ids) - 1 for _, ids, _ in items])
        kv_idx = torch.arange(self.steps.kv_len(max(start + len(ids) for _, ids, start in items)), device=self.device)
        inputs = [t.to(self.device) for t in (tok, pos, rows, last)]
        if self.compile_prefill and self.compile_prefill_many:
            logits = self._prefill_step()(*inputs, kv_idx)
        else:
            logits = self.model(inputs[0], inputs[1], inputs[2], kv_idx, last=inputs[3])
        for slot, ids, start in items:
            self.slots.occupy(slot, start + len(ids))
        return logits[:, -1].float()

    def _prefill_chunk(self, slot: int, chunk: torch.Tensor, start: int) -> torch.Tensor:
        n = chunk.numel()
        if self.compile_prefill and self.steps.pool is not None:
            return self.steps.prefill_replay(slot, chunk, start)
        kv_idx = torch.arange(self.steps.kv_len(start + n), device=self.device)
        inputs = [t.to(self.device) for t in prefill_inputs(slot, chunk, start, n, self.max_seq)]
        if self.compile_prefill and n > 1:  # a 1-token chunk would be a graph of its own (sizes 0 and 1 specialize)
            logits = self._prefill_step()(*inputs, kv_idx)
        else:
            tok, pos, _, last = inputs
            logits = self.model(tok, pos, slot, kv_idx, last=last)
        return logits[0, -1].float()

    def _prefill_step(self):
        """The compiled prompt forward (graphs.Steps.prefill_step)."""
        return self.steps.prefill_step()

    # ---- decode --------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, slots, tokens, positions) -> torch.Tensor:
        """One token for each of `slots` at its own position -> logits [len(slots), vocab] float32."""
        slots = list(slots)
        P = self.steps.padded_batch(max(slots) + 1)
        tok = torch.zeros(P, dtype=torch.long)
        pos = torch.full((P,), self.max_seq, dtype=torch.long)  # padding rows hit the trash row
        idx = torch.tensor(slots, dtype=torch.long)
        tok[idx] = torch.as_tensor(tokens, dtype=torch.long).view(-1).cpu()
        pos[idx] = torch.as_tensor(positions, dtype=torch.long).view(-1).cpu()
        if int(pos[idx].max()) >= self.max_seq:
            raise ValueError(f"decode position beyond max_seq {self.max_seq}")
        kv_idx = self._kv_idx[: self.steps.kv_len(int(pos[idx].max()) + 1)]
        logits = self.decode_padded(tok.to(self.device, non_blocking=True), pos.to(self.device, non_blocking=True), kv_idx)
        for s, p in zip(slots, pos[idx].tolist()):
            self.slots.occupy(s, p + 1)
        return logits[idx.to(self.device)].float()

    def decode_padded(self, tok: torch.Tensor, pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The raw step on device tensors of a bucket size (no host sync: benchmarks loop on it).
        Returns the logits in the step's own output buffer: copy before the next call."""
        return self.steps.decode_padded(tok, pos, kv_idx)
