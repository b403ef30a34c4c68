"""FastCore behind the server's decode seam (`server.backend.DecodeBackend`).

Scheduler slots map to FastCore's cache rows through the shared prefix cache (`prefix_cache.py`),
which hands out the lowest free row: FastCore is fastest when the live rows are the lowest ones
(its decode batch covers rows 0..max).  Reusing a cached prefix from another row is a copy of
that row's K/V positions on the device.

Which tokens each row holds is the prefix cache's record (`self.rows`); how many positions of a
live row are written is the core's (`core.slots`), and the next decode position is read there.
"""

from __future__ import annotations

from quantserve.server.config import EngineOptions
from quantserve.server.fastcore.core import FastCore
from quantserve.server.prefix_cache import RowBackend


class FastCoreBackend(RowBackend):
    def __init__(self, model, max_batch: int, context_length: int, weight_quant: str = "none",
                 profile: str = "native", compile: bool | None = None, prefill_chunk: int = EngineOptions.prefill_chunk,
                 device: str | None = None, prefix_cache: bool = True, kv_cache_dtype: str = EngineOptions.kv_cache_dtype):
        """model: a checkpoint folder or a loaded (not bitsandbytes-quantized) HF Llama-family model."""
        if getattr(getattr(model, "config", None), "quantization_config", None):
            raise ValueError("FastCore quantizes fp16 weights itself: give it the unquantized checkpoint "
                             "and weight_quant='int8' or 'int4'")
        self.core = FastCore(model, max_slots=max_batch, max_seq=context_length, weight_quant=weight_quant,
                             profile=profile, compile=compile, prefill_chunk=prefill_chunk, device=device,
                             kv_cache_dtype=kv_cache_dtype)
        if self.core.compile:
            # every decode shape compiled and recorded before /health says ready: lazily, the first
            # request to reach a new batch size waited seconds (and stalled everyone else)
            self.warm_up_s = self.core.warm_up(progress=True)
        self.vocab_size = self.core.args.vocab_size
        self.kv_capacity_tokens = max_batch * context_length
        self._init_rows(max_batch, prefix_cache)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        self.core.copy_kv(src, dst, n)

    def _truncate(self, row: int, n: int) -> None:
        self.core.occupy(row, n)

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0, all_logits: bool = False):
        row = self._row_for_prefill(slot, start)
        logits = self.core.prefill(row, prompt_ids, start, all_logits).cpu()
        self.rows.written(row, list(prompt_ids), start)
        return logits

    def prefill_many(self, items: list[tuple[int, list[int], int]]) -> list:
        rows = [self._row_for_prefill(slot, start) for slot, _, start in items]
        logits = self.core.prefill_many([(r, ids, start) for r, (_, ids, start) in zip(rows, items)]).cpu()
        for r, (_, ids, start) in zip(rows, items):
            self.rows.written(r, list(ids), start)
        return list(logits)

    def embed(self, slot: int, ids: list[int], pooling: str):
        row = self._row_for_prefill(slot, 0)
        vector = self.core.embed(row, ids, pooling).numpy()
        self.rows.written(row, list(ids), 0)  # real K/V of the prompt: a later prompt may reuse them
        return vector

    def decode(self, slots: list[int], tokens: list[int]):
        rows = [self.rows.row_of[s] for s in slots]
        positions = [self.core.slots.lengths[r] for r in rows]  # each row's next position (slots.py)
        logits = self.core.decode(rows, tokens, positions)
        for r, t, p in zip(rows, tokens, positions):
            self.rows.written(r, [t], p)
        return logits

    def free(self, slot: int) -> None:
        row = self.rows.release(slot)
        if row is not None:
            self.core.release(row)
