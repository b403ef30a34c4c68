"""The paged KV cache's bookkeeping: one pool of fixed-size blocks, a block table per sequence,
and automatic prefix caching over full blocks (vLLM's design: docs/design/prefix_caching.md).

    pool = BlockPool(num_blocks, max_seqs)
    cached = pool.start(seq, prompt)      # prompt[:cached] found in cached blocks: shared, not copied
    pool.reserve(seq, n)  -> bool         # blocks for the first n positions (False: the pool is full)
    pool.written(seq, ids)                # ids now follow what seq held: full blocks become findable
    pool.release(seq)                     # blocks back to the pool; hashed ones stay findable (LRU)

A sequence (one of `max_seqs` numbered slots) owns the blocks of its table in order: position p
of its tokens lives in block `table[seq][p // BLOCK]` at offset `p % BLOCK`.  The model writes and
reads K/V through that table (model.py), so memory is taken only as a sequence grows and no
sequence reserves a whole context.

Prefix caching: each full block is keyed by a hash of its tokens chained to the hash of the block
before it (so the key covers everything before it too).  A block keeps its key after its sequence
ends; a new prompt takes the longest run of its leading blocks found by key, sharing them (a
reference count) instead of computing them again.  Free blocks are reused least recently freed
first, and a sequence's tail blocks go before its head (its prefix is what others share); blocks
that hold no full, hashed block are reused before any cached one.  A match is checked against the
block's tokens and its predecessor (the same block, not reused since): a hash collision costs a
hit, never a wrong answer.  The last prompt token is never
taken from the cache: its forward gives the logits of the first new token.

Pure Python: the model's device-side block table mirrors `table` for the sequences in `dirty`.
"""

from __future__ import annotations

from collections import OrderedDict

from quantserve.server.prefix_cache import BLOCK, chain_hashes


class BlockPool:
    def __init__(self, num_blocks: int, max_seqs: int, prefix_cache: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, not {num_blocks}")
        self.num_blocks, self.max_seqs, self.enabled = num_blocks, max_seqs, prefix_cache
        self.table: list[list[int]] = [[] for _ in range(max_seqs)]  # each sequence's blocks, in order
        self.tokens: list[list[int]] = [[] for _ in range(max_seqs)]  # tokens whose K/V are written
        self._hashes: list[list[int]] = [[] for _ in range(max_seqs)]  # chained keys of its full blocks
        self.live = [False] * max_seqs
        self._refs = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks  # a full block's key while it is findable
        self._block_tokens: list[tuple | None] = [None] * num_blocks
        self._after: list[tuple | None] = [None] * num_blocks  # (block, its generation) it follows
        self._generation = [0] * num_blocks  # times a block was taken for new content
        self._cached: dict[int, int] = {}  # key -> block
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # reuse order
        self.dirty: set[int] = set()  # sequences whose table changed since the model last copied it
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, found cached (vLLM's prefix_cache_hits)
        self.preemptions = 0  # sequences whose blocks were taken back to make room (counted by the scheduler)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK

    def free_blocks(self) -> int:
        """Blocks no live sequence holds (cached ones included: they are taken when needed)."""
        return len(self._free)

    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def held(self, seq: int) -> int:
        """Positions of `seq` whose K/V are written; the next token goes at this one."""
        return len(self.tokens[seq])

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // BLOCK)

    def can_grow(self, seq: int, n_tokens: int) -> bool:
        """Would `reserve(seq, n_tokens)` succeed?"""
        return self.blocks_for(n_tokens) - len(self.table[seq]) <= len(self._free)

    def room(self, seq: int) -> int:
        """The most positions `seq` could hold with the blocks free now."""
        return (len(self.table[seq]) + len(self._free)) * BLOCK

    def held_tokens(self) -> int:
        """Tokens of live sequences (the KV-use gauge)."""
        return sum(len(t) for t, live in zip(self.tokens, self.live) if live)

    # ---- a sequence's life ---------------------------------------------------------------------
    def start(self, seq: int, prompt: list[int]) -> int:
        """`seq` begins with `prompt`: take the longest run of its leading full blocks that is
        cached (never the last token); returns how many tokens that is."""
        self.release(seq)
        self.live[seq] = True
        self.queried_tokens += len(prompt)
        n = self._match(seq, prompt, 0)
        self.hit_tokens += n
        return n

    def reuse(self, seq: int, prompt: list[int]) -> int:
        """More of `prompt` may be cached since `seq` started (a sequence admitted with it has
        computed it): take it when `seq` holds whole blocks and nothing past its tokens.  Returns
        how many tokens `seq` holds now."""
        have = self.held(seq)
        if not self.enabled or have % BLOCK or len(self.table[seq]) * BLOCK != have:
            return have
        n = self._match(seq, prompt, have // BLOCK)
        self.hit_tokens += n - have
        return n

    def keys(self, seq: int, tokens: list[int], n_blocks: int) -> list[int]:
        """The keys of the first n_blocks full blocks of `tokens`, which continue what `seq` holds
        (its own keys are reused; at most the blocks `tokens` fills)."""
        return chain_hashes(tokens, min(n_blocks, len(tokens) // BLOCK), list(self._hashes[seq]))

    def reserve(self, seq: int, n_tokens: int) -> bool:
        """Blocks for the first n_tokens positions of `seq`; False (and nothing taken) when the
        pool has too few free."""
        need = self.blocks_for(n_tokens) - len(self.table[seq])
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._generation[block] += 1
            self._refs[block] = 1
            self.table[seq].append(block)
        self.dirty.add(seq)
        return True

    def written(self, seq: int, ids: list[int]) -> None:
        """The model wrote `ids` after what `seq` held; its newly full blocks become findable."""
        tokens, hashes = self.tokens[seq], self._hashes[seq]
        if len(tokens) + len(ids) > len(self.table[seq]) * BLOCK:
            raise RuntimeError(f"sequence {seq} wrote past its {len(self.table[seq])} blocks")
        tokens.extend(ids)
        h = hashes[-1] if hashes else 0
        for i in range(len(hashes), len(tokens) // BLOCK):
            piece = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
            h = hash((h, *piece))
            hashes.append(h)
            block = self.table[seq][i]
            if self.enabled and self._key[block] is None and h not in self._cached:
                self._cached[h], self._key[block], self._block_tokens[block] = block, h, piece
                self._after[block] = self._predecessor(seq, i)

    def release(self, seq: int) -> None:
        """`seq` is over (or preempted): its blocks go back, tail first; cached ones stay findable."""
        for block in reversed(self.table[seq]):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._key[block] is None:  # nothing to find in it: reused before any cached block
                    self._free.move_to_end(block, last=False)
        if self.table[seq]:
            self.dirty.add(seq)
        self.table[seq], self.tokens[seq], self._hashes[seq] = [], [], []
        self.live[seq] = False

    def forget_all(self) -> None:
        """Drop every cached block's key and the counters (live sequences keep their blocks)."""
        for block in list(self._free):
            self._forget(block)
        self.queried_tokens = self.hit_tokens = 0

    # ---- internals -----------------------------------------------------------------------------
    def _match(self, seq: int, prompt: list[int], first: int) -> int:
        """Append the cached blocks that continue `prompt` from block `first` on; the tokens held."""
        hashes, table = self._hashes[seq], self.table[seq]
        h = hashes[-1] if hashes else 0
        for i in range(first, (len(prompt) - 1) // BLOCK if self.enabled else first):
            piece = tuple(prompt[i * BLOCK:(i + 1) * BLOCK])
            h = hash((h, *piece))
            block = self._cached.get(h)
            if block is None or self._block_tokens[block] != piece or self._after[block] != self._predecessor(seq, i):
                break
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table.append(block)
            hashes.append(h)
            self.tokens[seq].extend(piece)
            self.dirty.add(seq)
        return len(self.tokens[seq])

    def _predecessor(self, seq: int, i: int) -> tuple | None:
        """(block, generation) of `seq`'s block before its i-th, None for the first."""
        if i == 0:
            return None
        block = self.table[seq][i - 1]
        return block, self._generation[block]

    def _forget(self, block: int) -> None:
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = self._block_tokens[block] = self._after[block] = None
