"""FastCore behind the server's decode seam (`server.backend.DecodeBackend`), as a paged backend.

The scheduler's slots are FastCore's slots (block-table rows) one to one, and its KV pool
(`pool`, fastcore/blocks.py) is the prefix cache too: a new sequence shares the cached blocks of
its prompt's longest cached prefix instead of computing them (no copy).  `step` runs decodes and
prompt chunks of many sequences as one forward (server/paged_scheduler.py drives it).
"""

from __future__ import annotations

from quantserve.server.fastcore.core import FastCore


class FastCoreBackend:
    def __init__(self, model, max_batch: int, context_length: int, weight_quant: str = "none",
                 profile: str = "native", compile: bool | None = None, device: str | None = None,
                 prefix_cache: bool = True, kv_cache_dtype: str = "auto", kv_blocks: int | None = None,
                 max_batched_tokens: int = 2048, choices_file=None, kernel_table=None):
        """model: a checkpoint folder or a loaded (not bitsandbytes-quantized) HF Llama-family model.
        kv_blocks: the KV pool's size in blocks (None: what the memory holds, fastcore/core.py);
        max_batched_tokens: the most tokens one forward takes (the scheduler's budget);
        choices_file: where the weight kernels' choices are kept between starts; kernel_table: the
        choices shipped for this GPU model (fastcore/kernel_tables.py), or None."""
        if getattr(getattr(model, "config", None), "quantization_config", None):
            raise ValueError("FastCore quantizes fp16 weights itself: give it the unquantized checkpoint "
                             "and weight_quant='int8' or 'int4'")
        self.core = FastCore(model, max_slots=max_batch, max_seq=context_length, weight_quant=weight_quant,
                             profile=profile, compile=compile, device=device, kv_cache_dtype=kv_cache_dtype,
                             kv_blocks=kv_blocks, prefix_cache=prefix_cache, max_batched_tokens=max_batched_tokens)
        self.warm_up_s = 0.0
        if self.core.compile:
            # every decode graph recorded and the forward compiled before /health says ready:
            # lazily, the first request of a new shape waited seconds (and stalled everyone else)
            self.warm_up_s = self.core.warm_up(progress=True, max_tokens=max_batched_tokens,
                                               choices_file=choices_file, kernel_table=kernel_table)
        self.pool = self.core.pool
        self.vocab_size = self.core.args.vocab_size
        self.kv_capacity_tokens = self.pool.capacity_tokens

    def start(self, slot: int, prompt_ids: list[int]) -> int:
        return self.pool.start(slot, list(prompt_ids))

    def reuse(self, slot: int, prompt_ids: list[int], have: int) -> int:
        return self.pool.reuse(slot, list(prompt_ids))

    def step(self, items: list[tuple[int, list[int]]]):
        """Each (slot, ids) entry's tokens appended in one forward -> logits at each entry's last
        token, [len(items), vocab] float32 on the device."""
        return self.core.step(items)

    def launch_greedy(self, slots: list[int], positions: list[int], tokens):
        """A decode step launched, not waited for: (device picks, PendingTokens) (core.decode_greedy)."""
        return self.core.decode_greedy(slots, positions, tokens)

    def written(self, slot: int, ids: list[int]) -> None:
        """`ids` were fed to `slot` by a launched step (launch_greedy): the pool records them."""
        self.pool.written(slot, ids)

    def prefill(self, slot: int, prompt_ids: list[int], start: int = 0, all_logits: bool = False):
        return self.core.prefill(slot, prompt_ids, start, all_logits).cpu()

    def decode(self, slots: list[int], tokens: list[int]):
        return self.core.decode(slots, tokens)

    def embed(self, slot: int, ids: list[int], pooling: str):
        return self.core.embed(slot, ids, pooling).numpy()

    def free(self, slot: int) -> None:
        self.pool.release(slot)

    def forget_prefixes(self) -> None:
        self.pool.forget_all()

    def cached_tokens(self) -> int:
        return self.pool.held_tokens()

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self.pool.queried_tokens, self.pool.hit_tokens
