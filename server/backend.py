"""The decode seam: `DecodeBackend` owns the model and the KV memory, nothing else.

The scheduler (`scheduler.py`) decides who runs and samples the tokens; a backend only turns
tokens into next-token logits for sequences living in numbered slots (0 .. max_batch-1):

    prefill(slot, ids, start) -> logits[vocab]      # write ids at positions start.. of the slot's
                                                    # cache (start 0: a new sequence); last logits
    decode(slots, tokens)     -> logits[len(slots), vocab]  # append one token to each slot
    free(slot)                                      # drop the slot's KV cache

`HFBackend` below is the plain transformers version: each slot keeps its own KV tensors, and a
decode step left-pads them into one batch (attention mask + explicit position ids), runs the model
once and slices each sequence's cache back out.  Simple and exact, but it copies the caches every
step; a static-cache / CUDA-graph core (server/fastcore) implements the same three methods.
"""

from __future__ import annotations

import inspect
from typing import Protocol


class DecodeBackend(Protocol):
    vocab_size: int
    kv_capacity_tokens: int

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0):
        """Run prompt tokens into `slot`'s cache at positions start.. (start 0: the slot starts a new
        sequence; start > 0: a later chunk of the same prompt); return float32 CPU logits of the last."""

    def decode(self, slots: list[int], tokens: list[int]):
        """Append one token per slot; return float32 logits, one row per slot, in order, on the
        backend's device (the scheduler copies to the CPU only the rows it samples there)."""

    def free(self, slot: int) -> None: ...

    def cached_tokens(self) -> int:
        """Tokens held in KV memory right now, over all slots (the KV-cache use metric)."""


class HFBackend:
    """Continuous-batching decode on any transformers causal LM, with per-slot dynamic caches."""

    def __init__(self, model, max_batch: int, context_length: int):
        import torch

        self.model = model
        self.device = model.device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.kv_capacity_tokens = max_batch * context_length
        # transformers renamed `past_key_values` to `cache`; accept both releases
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._slots: dict[int, list[tuple]] = {}  # slot -> [(keys, values) per layer], [1, heads, len, dim]
        self._lengths: dict[int, int] = {}
        self._torch = torch

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0):
        from transformers import DynamicCache

        torch = self._torch
        ids = torch.tensor([prompt_ids], device=self.device)
        if start:  # a later chunk: continue the slot's cache (positions follow from its length)
            if self._lengths.get(slot) != start:
                raise RuntimeError(f"slot {slot} holds {self._lengths.get(slot)} tokens, not {start}")
            cache = DynamicCache(ddp_cache_data=self._slots[slot])
        else:
            cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        self._slots[slot] = [(layer.keys, layer.values) for layer in self._cache_of(out).layers]
        self._lengths[slot] = start + len(prompt_ids)
        return out.logits[0, -1].float().cpu()

    def decode(self, slots: list[int], tokens: list[int]):
        from transformers import DynamicCache

        torch = self._torch
        lengths = [self._lengths[s] for s in slots]
        longest = max(lengths)
        batch, n_layers = len(slots), len(self._slots[slots[0]])
        # left-pad every sequence's cache to the longest one; the mask hides the padding
        mask = torch.zeros(batch, longest + 1, dtype=torch.long, device=self.device)
        layers = []
        for layer in range(n_layers):
            k0, v0 = self._slots[slots[0]][layer]
            keys = k0.new_zeros(batch, k0.shape[1], longest, k0.shape[3])
            values = v0.new_zeros(batch, v0.shape[1], longest, v0.shape[3])
            for row, slot in enumerate(slots):
                k, v = self._slots[slot][layer]
                keys[row, :, longest - k.shape[2]:] = k[0]
                values[row, :, longest - v.shape[2]:] = v[0]
            layers.append((keys, values))
        for row, n in enumerate(lengths):
            mask[row, longest - n:] = 1
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        positions = torch.tensor(lengths, device=self.device).unsqueeze(1)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                             **{self._cache_kw: DynamicCache(ddp_cache_data=layers)})
        cache_layers = self._cache_of(out).layers
        for row, slot in enumerate(slots):
            start = longest - lengths[row]
            self._slots[slot] = [(layer.keys[row:row + 1, :, start:], layer.values[row:row + 1, :, start:])
                                 for layer in cache_layers]
            self._lengths[slot] += 1
        return out.logits[:, -1].float()

    def free(self, slot: int) -> None:
        self._slots.pop(slot, None)
        self._lengths.pop(slot, None)

    def cached_tokens(self) -> int:
        return sum(self._lengths.values())

    def _cache_of(self, out):
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values
