"""FastCore: the decode engine object the server's `hf` engine plugs in, and bench/decode.py times.

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
"""

from __future__ import annotations

import bisect
import sys
import time
from pathlib import Path

import torch

from quantserve.server.config import EngineOptions
from quantserve.server.fastcore.model import ModelArgs, Transformer
from quantserve.server.fastcore.quant import (PackedInt4, cat_rows, default_kernel, int4_tinygemm_supported,
                                              linear_weight_bytes, make_linear)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KV_BUCKET = 256


def _rope_of(rot) -> dict:
    """{"full": (inv_freq, scale)} from a transformers rotary embedding, plus "sliding" where the
    model rotates its sliding-window layers with frequencies of their own (Gemma 3)."""
    if hasattr(rot, "full_attention_inv_freq"):
        return {kind: (getattr(rot, f"{name}_inv_freq").detach().float().cpu(),
                       float(getattr(rot, f"{name}_attention_scaling", 1.0)))
                for kind, name in (("full", "full_attention"), ("sliding", "sliding_attention"))
                if hasattr(rot, f"{name}_inv_freq")}
    return {"full": (rot.inv_freq.detach().float().cpu(), float(getattr(rot, "attention_scaling", 1.0)))}


def _hf_tensors(hf_model):
    """name -> tensor getter over a Hugging Face Llama-style model, plus its config and rope."""
    sd = hf_model.state_dict()
    if "lm_head.weight" not in sd:  # tied embeddings
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd.__getitem__, sd.__contains__, hf_model.config, _rope_of(hf_model.model.rotary_emb)


def _random_tensors(cfg, device, dtype, seed: int = 0):
    """A getter that makes fresh random weights of the right shape (benchmarks: no checkpoint,
    no CPU RAM; each weight exists in fp16 only until it is quantized)."""
    a = ModelArgs.from_hf(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    shapes = {"q_proj": (q, a.dim), "k_proj": (kv, a.dim), "v_proj": (kv, a.dim), "o_proj": (a.dim, q),
              "gate_proj": (a.ffn_dim, a.dim), "up_proj": (a.ffn_dim, a.dim), "down_proj": (a.dim, a.ffn_dim)}

    def get(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):  # q_norm / k_norm (Qwen3) are per head
            width = a.head_dim if name.endswith(("q_norm.weight", "k_norm.weight")) else a.dim
            return torch.ones(width, device=device, dtype=dtype)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shape = (a.vocab_size, a.dim)
        else:
            shape = shapes[name.split(".")[-2]]
        if name.endswith(".bias"):
            return torch.zeros(shape[0], device=device, dtype=dtype)
        return torch.randn(shape, device=device, dtype=dtype, generator=gen) * 0.02

    has = lambda name: ((not name.endswith(".bias") or a.qkv_bias)  # noqa: E731
                        and not name.endswith(("qkv_proj.weight", "gate_up_proj.weight")))  # Llama's layout
    inv_freq = 1.0 / (_rope_theta(cfg) ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim))
    return get, has, cfg, {"full": (inv_freq, 1.0)}


def _prequantized(folder: Path):
    from quantserve.quant.prequantized import quantization_config

    return quantization_config(folder) if (folder / "config.json").is_file() else None


def _prequantized_tensors(folder: Path, keep_int4: bool):
    """A getter over an AWQ / GPTQ checkpoint: its 4-bit layers as PackedInt4 (for int4 serving:
    the checkpoint's own integers, no second quantization) or dequantized, the rest as stored.
    The rotary frequencies come from the model class's own rotary embedding, built from the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantserve.quant.prequantized import dequantize, linear_int4, quantized_layers, tensor_getter

    q = _prequantized(folder)
    raw, names = tensor_getter(folder)
    layers = set(quantized_layers(names))
    cfg = AutoConfig.from_pretrained(str(folder))
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the structure alone: no quantizer is asked for
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    rope = _rope_of(type(skeleton.model.rotary_emb)(cfg))  # built for real, outside the meta device

    def get(name: str):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in layers:
            if keep_int4:
                return PackedInt4(*linear_int4(raw, prefix, q), q["group_size"])
            return dequantize(raw, prefix, q)
        if name == "lm_head.weight" and name not in names:  # tied embeddings
            return raw("model.embed_tokens.weight")
        return raw(name)

    def has(name: str) -> bool:
        return name in names or (name.endswith(".weight") and name.removesuffix(".weight") in layers)

    return get, has, cfg, rope


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


class FastCore:
    def __init__(self, model, max_slots: int | None = 8, max_seq: int = 2048, dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, weight_quant: str = "none",
                 compile: bool | None = None, quant_kernel: str = "auto", group_size: int = 128,
                 prefill_chunk: int = EngineOptions.prefill_chunk, profile: str = "native", kv_budget_gib: float | None = None,
                 random_config=None, seed: int = 0, attention: str = "auto"):
        """model: a checkpoint folder, a loaded HF LlamaForCausalLM, or None with `random_config`
        (an HF config: random weights, for benchmarks).  max_slots=None sizes the KV cache from the
        GPU memory left after the weights (or from kv_budget_gib).  attention: the decode step's
        kernel, "triton" (split-KV, triton_attention.py), "sdpa", or "auto" (triton on a GPU)."""
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
        self.prequantized = None  # an AWQ / GPTQ checkpoint's quantization (quant/prequantized.py)
        self.prefill_chunk, self.max_seq = prefill_chunk, max_seq
        t0 = time.perf_counter()
        if random_config is not None:
            get, has, cfg, rope = _random_tensors(random_config, device, dtype, seed)
        elif isinstance(model, (str, Path)) and _prequantized(Path(model)) is not None:
            self.prequantized = _prequantized(Path(model))
            get, has, cfg, rope = _prequantized_tensors(Path(model), weight_quant == "int4")
        else:
            hf = _load_hf(model, dtype) if isinstance(model, (str, Path)) else model
            get, has, cfg, rope = _hf_tensors(hf)
        self.config = cfg
        self.args = a = ModelArgs.from_hf(cfg)
        self.model = self._build(get, has, a, weight_quant, quant_kernel, group_size)
        self.attention = _decode_attention_choice(attention, device)
        if self.attention == "triton":
            from quantserve.server.fastcore.triton_attention import decode_attention

            for layer in self.model.layers:
                # the kernel knows neither soft-capping nor another scale (nor a window: forward checks)
                if not (a.attn_softcap or a.attn_scale):
                    layer.attention.decode_kernel = decode_attention
        self.load_seconds = time.perf_counter() - t0
        if max_slots is None:
            max_slots = self.slots_for_budget(kv_budget_gib)
        self.max_slots = max_slots
        self.model.setup_caches(max_slots, max_seq, rope, dtype, device)
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        # at most 8 attended lengths: each (batch, length) pair is one CUDA graph to record
        self.kv_bucket = max(KV_BUCKET, -(-max_seq // (8 * KV_BUCKET)) * KV_BUCKET)
        self.lengths = [0] * max_slots
        self.in_use = [False] * max_slots
        self.compile = device.type == "cuda" if compile is None else compile
        self.compile_prefill = self.compile
        self.compile_prefill_many = True  # prefill_many through the compiled prompt graph (see warm_up)
        self._steps: dict[str, object] = {}
        self._kv_idx = torch.arange(max_seq, device=device)
        # (batch, KV length) -> (CUDA graph, its input tensors, its output); CUDA + compile only
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.compile and device.type == "cuda" else None

    # ---- building ------------------------------------------------------------------------------
    def _build(self, get, has, a: ModelArgs, mode: str, kernel: str, group_size: int) -> Transformer:
        dev, dt = self.device, self.dtype

        def w(name):
            return get(name).to(device=dev)

        with torch.device("meta"):
            m = Transformer(a)
        m.tok_embeddings.weight = torch.nn.Parameter(w("model.embed_tokens.weight").to(dt), requires_grad=False)
        m.norm.weight = torch.nn.Parameter(w("model.norm.weight").to(dt), requires_grad=False)
        # an AWQ / GPTQ checkpoint served in int4 keeps its own 4-bit layers and the float ones
        # (lm_head, usually) as its authors left them; any other mode quantizes everything alike
        packed = mode == "int4" and getattr(self, "prequantized", None) is not None
        lin = lambda wt, b: make_linear(wt, b, "int4" if isinstance(wt, PackedInt4) else  # noqa: E731
                                        "none" if packed else mode, dt, kernel, group_size)
        for i, layer in enumerate(m.layers):
            p = f"model.layers.{i}."
            if has(p + "self_attn.qkv_proj.weight"):  # Phi-3: q, k and v already in one matrix
                qkv = w(p + "self_attn.qkv_proj.weight")
            else:
                qkv = cat_rows([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if a.qkv_bias and has(p + "self_attn.q_proj.bias") else None
            layer.attention.wqkv = lin(qkv, bias)
            layer.attention.wo = lin(w(p + "self_attn.o_proj.weight"), None)
            if has(p + "mlp.gate_up_proj.weight"):  # Phi-3: gate and up fused, gate first
                gate_up = w(p + "mlp.gate_up_proj.weight")
            else:
                gate_up = cat_rows([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            layer.feed_forward.w13 = lin(gate_up, None)
            layer.feed_forward.w2 = lin(w(p + "mlp.down_proj.weight"), None)
            if a.qk_norm:
                layer.attention.q_norm.weight = torch.nn.Parameter(w(p + "self_attn.q_norm.weight").to(dt), requires_grad=False)
                layer.attention.k_norm.weight = torch.nn.Parameter(w(p + "self_attn.k_norm.weight").to(dt), requires_grad=False)
            norm = lambda name: torch.nn.Parameter(w(p + name).to(dt), requires_grad=False)  # noqa: E731
            layer.attention_norm.weight = norm("input_layernorm.weight")
            if a.sandwich_norms:  # Gemma 2: its "post_attention_layernorm" follows the attention
                layer.post_attention_norm.weight = norm("post_attention_layernorm.weight")
                layer.ffn_norm.weight = norm("pre_feedforward_layernorm.weight")
                layer.post_ffn_norm.weight = norm("post_feedforward_layernorm.weight")
            else:  # Llama's "post_attention_layernorm" is the norm before the MLP
                layer.ffn_norm.weight = norm("post_attention_layernorm.weight")
            del qkv
        m.output = lin(w("lm_head.weight"), None)
        return m.eval()

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read by one decode step: every linear layer, the norms, one embedding row."""
        m = self.model
        lin = sum(linear_weight_bytes(mod) for mod in m.modules()
                  if mod is not m.tok_embeddings and (hasattr(mod, "weight_bytes") or isinstance(mod, torch.nn.Linear)))
        norms = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "norm" in n)
        return lin + norms + self.args.dim * m.tok_embeddings.weight.element_size()

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
        per_slot = (self.max_seq + 1) * self.args.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8) / 2**30
        return max(1, min(BATCH_BUCKETS[-1], int((budget - reserve_gib) / per_slot)))

    # ---- slots ---------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [i for i, used in enumerate(self.in_use) if not used]

    def acquire(self) -> int:
        """The lowest free slot (keeps active slots compact, so decode batches stay small)."""
        free = self.free_slots()
        if not free:
            raise RuntimeError("no free KV-cache slot")
        self.in_use[free[0]] = True
        self.lengths[free[0]] = 0
        return free[0]

    def release(self, slot: int) -> None:
        """The slot's sequence is over (its K/V stay where they are: a prefix cache may copy them)."""
        self.in_use[slot] = False
        self.lengths[slot] = 0

    def occupy(self, slot: int, length: int) -> None:
        """`slot` holds a live sequence whose first `length` positions are already in the cache."""
        self.in_use[slot] = True
        self.lengths[slot] = length

    @torch.inference_mode()
    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """dst's first n cache positions := src's (prefix caching: a copy instead of a prompt
        forward).  In place, so the captured CUDA graphs keep reading the same buffers."""
        for layer in self.model.layers:
            att = layer.attention
            att.k_cache[dst, :, :n].copy_(att.k_cache[src, :, :n])
            att.v_cache[dst, :, :n].copy_(att.v_cache[src, :, :n])
        if self.in_use[dst]:
            self.lengths[dst] = n

    def kv_usage(self) -> float:
        """Fraction of the KV cache's token positions holding live tokens."""
        return sum(self.lengths) / (self.max_slots * self.max_seq)

    # ---- running -------------------------------------------------------------------------------
    def _kv_len(self, n: int) -> int:
        return min(self.max_seq, -(-n // self.kv_bucket) * self.kv_bucket)

    def kv_lengths(self) -> list[int]:
        """Every attended KV length a step can run at (multiples of `kv_bucket`, and max_seq)."""
        return sorted({self._kv_len(n) for n in range(1, self.max_seq + 1, self.kv_bucket)} | {self.max_seq})

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every (padded batch, attended KV length) a decode step can run at."""
        return [(b, n) for b in self.buckets for n in self.kv_lengths()]

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

        if self.compile_prefill and self._graph_pool is not None:
            shapes = self.prefill_shapes()
            for width, length in track(shapes, "recording prompt shapes (width x KV length)", "shape",
                                       enabled=progress):
                self._prefill_graph(width, length)
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

    @torch.inference_mode()
    def prefill(self, slot: int, ids, start: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Write `ids` into `slot` at positions start.. and return the last position's logits
        ([vocab]), or with all_logits every position's ([n, vocab]: prompt log-probabilities;
        eager, as scoring is not what the compiled graphs are recorded for)."""
        ids = torch.as_tensor(list(ids) if not torch.is_tensor(ids) else ids, dtype=torch.long).view(-1).cpu()
        n = ids.numel()
        if n == 0 or start + n > self.max_seq:
            raise ValueError(f"prefill of {n} tokens at {start} does not fit max_seq {self.max_seq}")
        self.in_use[slot] = True
        rows = []
        for c0 in range(0, n, self.prefill_chunk):
            chunk, at = ids[c0:c0 + self.prefill_chunk], start + c0
            if all_logits:
                rows.append(self._eager_chunk(slot, chunk, at))
            else:
                logits = self._prefill_chunk(slot, chunk, at)
        self.lengths[slot] = start + n
        return torch.cat(rows) if all_logits else logits

    @torch.inference_mode()
    def embed(self, slot: int, ids: list[int], pooling: str) -> torch.Tensor:
        """Write `ids` into `slot` from position 0 (eagerly, in chunks) and return the final hidden
        state pooled over the prompt: the last token's ("last") or the mean of all ("mean")."""
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        if not 0 < ids_t.numel() <= self.max_seq:
            raise ValueError(f"an embedding input of {ids_t.numel()} tokens does not fit max_seq {self.max_seq}")
        self.in_use[slot] = True
        total, last = None, None
        for c0 in range(0, ids_t.numel(), self.prefill_chunk):
            h = self._eager_chunk(slot, ids_t[c0:c0 + self.prefill_chunk], c0, hidden=True)
            total = h.sum(0) if total is None else total + h.sum(0)
            last = h[-1]
        self.lengths[slot] = ids_t.numel()
        return (total / ids_t.numel() if pooling == "mean" else last).cpu()

    def _eager_chunk(self, slot: int, chunk: torch.Tensor, start: int, hidden: bool = False) -> torch.Tensor:
        """One prompt chunk at positions start.., eagerly, with every position's output ([n, vocab]
        logits, or [n, dim] final hidden states): scoring and embeddings, which the compiled
        graphs (last position only) do not give."""
        kv_idx = torch.arange(self._kv_len(start + chunk.numel()), device=self.device)
        tok, pos = (t.to(self.device) for t in self._prefill_inputs(slot, chunk, start, chunk.numel())[:2])
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
        kv_idx = torch.arange(self._kv_len(max(start + len(ids) for _, ids, start in items)), device=self.device)
        inputs = [t.to(self.device) for t in (tok, pos, rows, last)]
        if self.compile_prefill and self.compile_prefill_many:
            logits = self._prefill_step()(*inputs, kv_idx)
        else:
            logits = self.model(inputs[0], inputs[1], inputs[2], kv_idx, last=inputs[3])
        for slot, ids, start in items:
            self.in_use[slot] = True
            self.lengths[slot] = start + len(ids)
        return logits[:, -1].float()

    def _prefill_chunk(self, slot: int, chunk: torch.Tensor, start: int) -> torch.Tensor:
        n = chunk.numel()
        if self.compile_prefill and self._graph_pool is not None:
            return self._prefill_replay(slot, chunk, start)
        kv_idx = torch.arange(self._kv_len(start + n), device=self.device)
        inputs = [t.to(self.device) for t in self._prefill_inputs(slot, chunk, start, n)]
        if self.compile_prefill and n > 1:  # a 1-token chunk would be a graph of its own (sizes 0 and 1 specialize)
            logits = self._prefill_step()(*inputs, kv_idx)
        else:
            tok, pos, _, last = inputs
            logits = self.model(tok, pos, slot, kv_idx, last=last)
        return logits[0, -1].float()

    def _prefill_inputs(self, slot: int, chunk: torch.Tensor, start: int, width: int) -> list[torch.Tensor]:
        """Host tensors (tokens, positions, cache row, index of the last token) for one prompt chunk
        padded to `width` tokens; padding sits at the trash position, which no prompt attends to."""
        n = chunk.numel()
        tok = torch.zeros((1, width), dtype=torch.long)
        pos = torch.full((1, width), self.max_seq, dtype=torch.long)
        tok[0, :n], pos[0, :n] = chunk, torch.arange(start, start + n)
        return [tok, pos, torch.tensor([slot]), torch.tensor([max(n - 1, 0)])]

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
            shapes += [(w, n) for n in self.kv_lengths() if n >= self._kv_len(shortest)]
            shortest = w + 1
        return shapes

    def _prefill_replay(self, slot: int, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """A prompt chunk as one CUDA-graph replay: launching the compiled graph's ~25 kernels per
        layer from Python took several times the GPU's own time for a prompt (bench/RESULTS.md)."""
        n = chunk.numel()
        width = next(w for w in self.prefill_widths() if w >= n)
        graph, static, _, out = self._prefill_graph(width, self._kv_len(start + n))
        for dst, src in zip(static, self._prefill_inputs(slot, chunk, start, width)):
            dst.copy_(src)
        graph.replay()
        return out[0, -1].float().clone()  # the graph's own buffer: the next replay overwrites it

    def _prefill_graph(self, width: int, length: int) -> tuple:
        key = ("prefill", width, length)
        if key not in self._graphs:
            # record at the trash position only: the eager runs before the capture write nothing real
            static = [t.to(self.device) for t in self._prefill_inputs(0, torch.zeros(0, dtype=torch.long), 0, width)]
            kv_idx = torch.arange(length, device=self.device)
            graph, out = self._capture(self._prefill_step(), *static, kv_idx)
            # every input stays referenced: the graph reads them at their recorded addresses, and
            # a freed one is soon someone else's memory (garbage attention masks, measured)
            self._graphs[key] = (graph, static, kv_idx, out)
        return self._graphs[key]

    def _prefill_step(self):
        """The prompt forward, compiled once for every prompt length, KV length and slot (the slot
        goes in as a tensor).  Eager, a prompt's ~20 small ops per layer cost more Python than GPU
        time: under load the server spent most of its time there (bench/RESULTS.md)."""
        if "prefill" not in self._steps:
            torch._dynamo.config.recompile_limit += 2
            compiled = torch.compile(self._prefill_forward, fullgraph=True, dynamic=True,
                                     options=_cpu_compile_options(self.device))

            def step(*inputs):
                # no "duck sizing": a prompt as long as its KV prefix must not tie the two sizes
                with torch.fx.experimental._config.patch(use_duck_shape=False):
                    return compiled(*inputs)
            self._steps["prefill"] = step
        return self._steps["prefill"]

    def _prefill_forward(self, tok, pos, rows, last, kv_idx):
        return self.model(tok, pos, rows, kv_idx, last=last)

    def _step_fn(self, batch: int):
        """The decode forward for one padded batch size: compiled (dynamic sizes) when `compile`."""
        key = "b1" if batch == 1 else "bN"
        if key not in self._steps:
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
            self._steps[key] = fn
        return self._steps[key]

    def _decode_b1(self, tokens, pos, kv_idx):
        return self.model(tokens.view(-1, 1), pos.view(-1, 1), 0, kv_idx)[:, 0]

    def _decode_bn(self, tokens, pos, kv_idx):
        return self.model(tokens.view(-1, 1), pos.view(-1, 1), 0, kv_idx)[:, 0]

    @torch.inference_mode()
    def decode(self, slots, tokens, positions) -> torch.Tensor:
        """One token for each of `slots` at its own position -> logits [len(slots), vocab] float32."""
        slots = list(slots)
        P = self.buckets[bisect.bisect_left(self.buckets, max(slots) + 1)]
        tok = torch.zeros(P, dtype=torch.long)
        pos = torch.full((P,), self.max_seq, dtype=torch.long)  # padding rows hit the trash row
        idx = torch.tensor(slots, dtype=torch.long)
        tok[idx] = torch.as_tensor(tokens, dtype=torch.long).view(-1).cpu()
        pos[idx] = torch.as_tensor(positions, dtype=torch.long).view(-1).cpu()
        if int(pos[idx].max()) >= self.max_seq:
            raise ValueError(f"decode position beyond max_seq {self.max_seq}")
        kv_idx = self._kv_idx[: self._kv_len(int(pos[idx].max()) + 1)]
        logits = self.decode_padded(tok.to(self.device, non_blocking=True), pos.to(self.device, non_blocking=True), kv_idx)
        for s, p in zip(slots, pos[idx].tolist()):
            self.lengths[s] = p + 1
        return logits[idx.to(self.device)].float()

    def decode_padded(self, tok: torch.Tensor, pos: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The raw step on device tensors of a bucket size (no host sync: benchmarks loop on it).
        Returns the logits in the step's own output buffer: copy before the next call."""
        fn = self._step_fn(tok.shape[0])
        if self._graph_pool is None:
            return fn(*self._mark_dynamic(tok, pos, kv_idx))
        key = (tok.shape[0], kv_idx.shape[0])
        if key not in self._graphs:
            static_tok, static_pos, static_kv = self._mark_dynamic(tok.clone(), pos.clone(), kv_idx)
            self._graphs[key] = (*self._capture(fn, static_tok, static_pos, static_kv), static_tok, static_pos, static_kv)
        graph, out, static_tok, static_pos, _ = self._graphs[key]
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
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = fn(*inputs)
        return graph, out


def _decode_attention_choice(choice: str, device: torch.device) -> str:
    if choice not in ("auto", "triton", "sdpa"):
        raise ValueError(f"unknown attention {choice!r} (auto, triton or sdpa)")
    if choice == "auto":
        from quantserve.server.fastcore.quant import triton_ops

        return "triton" if device.type == "cuda" and triton_ops() is not None else "sdpa"
    if choice == "triton" and device.type != "cuda":
        raise ValueError("the Triton decode attention runs on a CUDA GPU only")
    return choice


def _load_hf(path, dtype: torch.dtype):
    """The checkpoint on the CPU in the serving dtype; weights move to the device one at a time."""
    from quantserve.modeling import load_model

    return load_model(Path(path), dtype=str(dtype).removeprefix("torch."), device="cpu")


def _cpu_compile_options(device: torch.device) -> dict:
    """inductor's options for the dynamic-shape prompt graph.  On a CPU whose vector ISA inductor
    picks as AVX2 (no AVX-512: many AMD EPYCs), torch 2.13's vectorized C++ for this graph gave
    garbage K/V (NaN logits) where the eager path and the scalar code agree (measured with
    ATEN_CPU_CAPABILITY=avx2 on an AVX-512 Xeon); scalar code there.  GPUs: inductor's defaults."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": 1} if str(pick_vec_isa()) == "avx2" else {}
