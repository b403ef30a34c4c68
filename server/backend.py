"""The decode seam: `DecodeBackend` owns the model and the KV memory, nothing else.

The scheduler (`scheduler.py`) decides who runs and samples the tokens; a backend only turns
tokens into next-token logits for sequences living in numbered slots (0 .. max_batch-1):

    start(slot, prompt_ids)   -> n                  # a new sequence: prompt_ids[:n] already cached
    reuse(slot, prompt_ids, have) -> n              # more of the prompt found cached since (or have)
    prefill(slot, ids, start) -> logits[vocab]      # write ids at positions start.. of the slot's
                                                    # cache; the last position's logits
    decode(slots, tokens)     -> logits[len(slots), vocab]  # append one token to each slot
    free(slot)                                      # the sequence is over

Each slot's sequence lives in a KV row; finished rows keep their tokens so that later prompts
starting the same way skip that part of the prefill (prefix_cache.py, shared by every backend).

`HFBackend` below is the plain transformers version: each row keeps its own KV tensors, and a
decode step left-pads them into one batch (attention mask + explicit position ids), runs the model
once and slices each sequence's cache back out.  Simple and exact, but it copies the caches every
step; a static-cache / CUDA-graph core (server/fastcore) implements the same methods.
"""

from __future__ import annotations

import inspect
from typing import Protocol

from quantserve.server.prefix_cache import RowBackend


class DecodeBackend(Protocol):
    vocab_size: int
    kv_capacity_tokens: int

    def start(self, slot: int, prompt_ids: list[int]) -> int:
        """Begin a new sequence in `slot` for this prompt; return how many of its first tokens are
        already in the slot's cache (prefill goes on from there; never the whole prompt)."""

    def reuse(self, slot: int, prompt_ids: list[int], have: int) -> int:
        """The slot holds prompt_ids[:have]: take more of the prompt from the cache if another
        sequence has computed it since; return how many tokens the slot holds now."""

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0, all_logits: bool = False):
        """Run prompt tokens into `slot`'s cache at positions start..; return float32 CPU logits of
        the last ([vocab]), or with all_logits of every position ([n, vocab]: prompt logprobs).
        (start 0 on a slot not started: a new sequence, nothing reused.)"""

    def decode(self, slots: list[int], tokens: list[int]):
        """Append one token per slot; return float32 logits, one row per slot, in order, on the
        backend's device (the scheduler copies to the CPU only the rows it samples there)."""

    def embed(self, slot: int, ids: list[int], pooling: str):
        """The final hidden state of `ids` (a new sequence in `slot`), pooled: "last" token or
        "mean" of all; a float32 numpy vector, not normalized."""

    def free(self, slot: int) -> None: ...

    def cached_tokens(self) -> int:
        """Tokens of live sequences held in KV memory right now (the KV-cache use metric)."""

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up in the prefix cache, tokens found there), since start."""


class HFBackend(RowBackend):
    """Continuous-batching decode on any transformers causal LM, with per-row dynamic caches."""

    def __init__(self, model, max_batch: int, context_length: int, prefix_cache: bool = True):
        import torch

        self.model = model
        self.device = model.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.kv_capacity_tokens = max_batch * context_length
        # transformers renamed `past_key_values` to `cache`; accept both releases
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._kv: dict[int, list[tuple]] = {}  # row -> [(keys, values) per layer], [1, heads, len, dim]
        self._torch = torch
        self._init_rows(max_batch, prefix_cache)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        # views: a decode step builds new tensors (torch.cat), so src's later steps never write them
        self._kv[dst] = [(k[:, :, :n], v[:, :, :n]) for k, v in self._kv[src]]

    def _truncate(self, row: int, n: int) -> None:
        if n == 0:
            self._kv.pop(row, None)
        else:
            self._copy_rows(row, row, n)

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0, all_logits: bool = False):
        from transformers import DynamicCache

        torch = self._torch
        row = self._row_for_prefill(slot, start)
        ids = torch.tensor([prompt_ids], device=self.device)
        if start:  # continue the row's cache (positions follow from its length)
            self._truncate(row, start)
            cache = DynamicCache(ddp_cache_data=self._kv[row])
        else:
            cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1,
                             **{self._cache_kw: cache})
        self._kv[row] = [(layer.keys, layer.values) for layer in self._cache_of(out).layers]
        self.rows.written(row, list(prompt_ids), start)
        return out.logits[0].float().cpu() if all_logits else out.logits[0, -1].float().cpu()

    def embed(self, slot: int, ids: list[int], pooling: str):
        torch = self._torch
        with torch.inference_mode():  # the decoder alone: its last hidden state is after the final norm
            h = self.model.get_decoder()(input_ids=torch.tensor([ids], device=self.device)).last_hidden_state[0]
        h = h.float()
        return (h.mean(0) if pooling == "mean" else h[-1]).cpu().numpy()

    def decode(self, slots: list[int], tokens: list[int]):
        from transformers import DynamicCache

        torch = self._torch
        rows = [self.rows.row_of[s] for s in slots]
        lengths = [len(self.rows.tokens[r]) for r in rows]
        longest = max(lengths)
        batch, n_layers = len(slots), len(self._kv[rows[0]])
        # left-pad every sequence's cache to the longest one; the mask hides the padding
        mask = torch.zeros(batch, longest + 1, dtype=torch.long, device=self.device)
        layers = []
        for layer in range(n_layers):
            k0, v0 = self._kv[rows[0]][layer]
            keys = k0.new_zeros(batch, k0.shape[1], longest, k0.shape[3])
            values = v0.new_zeros(batch, v0.shape[1], longest, v0.shape[3])
            for i, r in enumerate(rows):
                k, v = self._kv[r][layer]
                keys[i, :, longest - k.shape[2]:] = k[0]
                values[i, :, longest - v.shape[2]:] = v[0]
            layers.append((keys, values))
        for row, n in enumerate(lengths):
            mask[row, longest - n:] = 1
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        positions = torch.tensor(lengths, device=self.device).unsqueeze(1)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: DynamicCache(ddp_cache_data=layers)})
        cache_layers = self._cache_of(out).layers
        for i, r in enumerate(rows):
            start = longest - lengths[i]
            self._kv[r] = [(layer.keys[i:i + 1, :, start:], layer.values[i:i + 1, :, start:])
                           for layer in cache_layers]
            self.rows.written(r, [tokens[i]], lengths[i])
        return out.logits[:, -1].float()

    def _cache_of(self, out):
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values
