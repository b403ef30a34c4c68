"""FastCore behind the server's decode seam (`server.backend.DecodeBackend`).

The scheduler numbers its slots itself and reuses the most recently freed one; FastCore is fastest
when the live slots are the lowest ones (its decode batch covers slots 0..max).  So this adapter
maps each scheduler slot to the lowest free FastCore slot at prefill time.
"""

from __future__ import annotations

from quantserve.server.fastcore.core import FastCore


class FastCoreBackend:
    def __init__(self, model, max_batch: int, context_length: int, weight_quant: str = "none",
                 profile: str = "native", compile: bool | None = None, prefill_chunk: int = 512,
                 device: str | None = None):
        """model: a checkpoint folder or a loaded (not bitsandbytes-quantized) HF Llama-family model."""
        if getattr(getattr(model, "config", None), "quantization_config", None):
            raise ValueError("FastCore quantizes fp16 weights itself: give it the unquantized checkpoint "
                             "and weight_quant='int8' or 'int4'")
        self.core = FastCore(model, max_slots=max_batch, max_seq=context_length, weight_quant=weight_quant,
                             profile=profile, compile=compile, prefill_chunk=prefill_chunk, device=device)
        if self.core.compile:
            # every decode shape compiled and recorded before /health says ready: lazily, the first
            # request to reach a new batch size waited seconds (and stalled everyone else)
            self.warm_up_s = self.core.warm_up(progress=True)
        self.vocab_size = self.core.args.vocab_size
        self.kv_capacity_tokens = max_batch * context_length
        self._slot: dict[int, int] = {}  # scheduler slot -> FastCore slot

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0):
        if start == 0:  # a new sequence
            self.free(slot)
            self._slot[slot] = self.core.acquire()
        return self.core.prefill(self._slot[slot], prompt_ids, start).cpu()

    def decode(self, slots: list[int], tokens: list[int]):
        cs = [self._slot[s] for s in slots]
        return self.core.decode(cs, tokens, [self.core.lengths[c] for c in cs])

    def free(self, slot: int) -> None:
        s = self._slot.pop(slot, None)
        if s is not None:
            self.core.release(s)

    def cached_tokens(self) -> int:
        return sum(self.core.lengths)
