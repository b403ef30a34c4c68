"""Automatic prefix caching over a backend's KV rows: a new sequence starts from the longest
prefix of its prompt that any row already computed, and finished sequences leave their K/V behind.

Every backend keeps its sequences in numbered KV rows (FastCore's static cache rows, llama.cpp's
sequence ids, the transformers backend's per-row tensors).  `KVRows` records which tokens each row
holds valid K/V for, live or finished, and hands rows out:

    row, cached = rows.start(slot, prompt)   # a row for the scheduler's slot: prompt[:cached] is in it
    cached = rows.reuse(slot, prompt, have)  # later: another row may since hold more of the prompt
    rows.written(row, ids, start)            # the backend wrote ids at positions start..
    rows.release(slot)                       # the sequence ended; its tokens stay, to be matched

The backend supplies `copy(src, dst, n)`: make dst's first n positions a copy of src's.  A copy
of K/V rows on the device costs far less than the prompt forward it replaces (copying 1,500
tokens of an 8B model's cache moves ~200 MB; computing them reads all 8 GB of weights, several
times), so unlike vLLM's paged blocks the cache shares nothing and copies instead.  Matching is
vLLM's, though: each row's tokens are hashed in blocks of BLOCK, every hash chained to the ones
before it, and an index maps each hash to the rows holding that exact prefix; a lookup walks the
prompt's chain (a dict probe per block, however many rows) and finishes token by token inside
the next block.  A match is checked against the tokens before it is used: a hash collision can
cost a hit, never a wrong answer.

Rows are handed out lowest-first: FastCore's decode batch covers rows 0..max(live row), so compact
rows keep batches small.  What the lowest free row held is first moved to the least recently used
free row when that is older (the cache keeps the most recent finished sequences, LRU), unless the
new prompt starts with it.  The last prompt token is never taken from the cache: its forward gives
the logits of the first new token.
"""

from __future__ import annotations

import itertools
from typing import Callable


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (list compares run in C)."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds; a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


BLOCK = 16  # tokens per hashed block


def chain_hashes(tokens: list[int], n_blocks: int, chain: list[int]) -> list[int]:
    """`chain` (the hashes of the first len(chain) blocks) extended to n_blocks: each block's hash
    covers its tokens and, through the previous hash, every token before it."""
    h = chain[-1] if chain else 0
    for i in range(len(chain), n_blocks):
        h = hash((h, *tokens[i * BLOCK:(i + 1) * BLOCK]))
        chain.append(h)
    return chain


class KVRows:
    def __init__(self, n_rows: int, copy: Callable[[int, int, int], None], enabled: bool = True):
        self.enabled = enabled
        self._copy = copy
        self.row_of: dict[int, int] = {}  # scheduler slot -> row of its live sequence
        self.tokens: list[list[int]] = [[] for _ in range(n_rows)]  # valid K/V per row, in position order
        self.live = [False] * n_rows
        self._hashes: list[list[int]] = [[] for _ in range(n_rows)]  # chained hashes of each row's full blocks
        self._holders: dict[int, set[int]] = {}  # block hash -> the rows whose prefix it is
        self._used = [0] * n_rows  # a logical clock: when a row's content was last written or matched
        self._clock = itertools.count(1)
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, taken from the cache (vLLM's prefix_cache_hits)

    def free_rows(self) -> list[int]:
        return [r for r, live in enumerate(self.live) if not live]

    def held_tokens(self) -> int:
        """Tokens of live sequences (what the KV-use gauge reports; finished rows are reclaimable)."""
        return sum(len(t) for t, live in zip(self.tokens, self.live) if live)

    def start(self, slot: int, prompt: list[int]) -> tuple[int, int]:
        """A row for the new sequence in `slot`, and how many prompt tokens that row already holds."""
        self.release(slot)
        free = self.free_rows()
        if not free:
            raise RuntimeError("no free KV row")
        row = free[0]
        self.queried_tokens += len(prompt)
        source, n = self._best(prompt, exclude=None)
        if self.tokens[row] and source != row:
            self._keep_elsewhere(row, [r for r in free[1:] if r != source])
        if source is not None and source != row:
            self._copy(source, row, n)
            self._set(row, prompt[:n])
        else:  # its own first n tokens are the prompt's (n may be 0)
            self._set(row, prompt[:n], keep_blocks=n // BLOCK)
        self.live[row] = True
        self.row_of[slot] = row
        self._touch(row)
        if source is not None:
            self._touch(source)
        self.hit_tokens += n
        return row, n

    def reuse(self, slot: int, prompt: list[int], have: int) -> int:
        """`have` prompt tokens are in the slot's row: if another row now holds a longer prefix of
        the prompt (a sequence admitted with this one has prefilled it since), copy it over.
        Returns how many prompt tokens the row holds now."""
        row = self.row_of[slot]
        if not self.enabled or have >= len(prompt) - 1:
            return have
        source, n = self._best(prompt, exclude=row)
        if source is None or n <= have:
            return have
        self._copy(source, row, n)
        self._set(row, prompt[:n], keep_blocks=have // BLOCK)
        self._touch(source)
        self.hit_tokens += n - have
        return n

    def written(self, row: int, ids: list[int], start: int) -> None:
        """The backend wrote `ids` at positions start.. of `row` (after its forward succeeded)."""
        t = self.tokens[row]
        if start != len(t):  # positions from `start` on were overwritten: no longer what t says
            del t[start:]
        t.extend(ids)
        self._index(row, keep_blocks=start // BLOCK)

    def release(self, slot: int) -> int | None:
        """The slot's sequence ended (its row's tokens stay, to be matched); returns that row."""
        row = self.row_of.pop(slot, None)
        if row is not None:
            self.live[row] = False
            if not self.enabled:
                self._set(row, [])
        return row

    def forget_all(self) -> None:
        """Drop every finished row's tokens (live rows keep theirs) and the counters."""
        for r, live in enumerate(self.live):
            if not live:
                self._set(r, [])
        self.queried_tokens = self.hit_tokens = 0

    # ---- internals -----------------------------------------------------------------------------
    def _touch(self, row: int) -> None:
        self._used[row] = next(self._clock)

    def _set(self, row: int, tokens: list[int], keep_blocks: int = 0) -> None:
        """The row now holds `tokens`; its first `keep_blocks` blocks are the ones it held before."""
        self.tokens[row] = list(tokens)
        self._index(row, keep_blocks)

    def _index(self, row: int, keep_blocks: int) -> None:
        """Bring the row's block hashes (and the index) in line with its tokens."""
        hashes = self._hashes[row]
        keep = min(keep_blocks, len(hashes))
        for h in hashes[keep:]:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(row)
                if not holders:
                    del self._holders[h]
        del hashes[keep:]
        if not self.enabled:
            return
        chain_hashes(self.tokens[row], len(self.tokens[row]) // BLOCK, hashes)
        for h in hashes[keep:]:
            self._holders.setdefault(h, set()).add(row)

    def _best(self, prompt: list[int], exclude: int | None) -> tuple[int | None, int]:
        """(the row holding the longest prefix of prompt, its length), (None, 0) when none does."""
        limit = len(prompt) - 1
        if not self.enabled or limit <= 0:
            return None, 0
        matched, blocks, h = None, 0, 0
        for i in range(limit // BLOCK):  # the whole blocks some row holds, through the index
            h = hash((h, *prompt[i * BLOCK:(i + 1) * BLOCK]))
            holders = self._holders.get(h)
            if not holders or (exclude in holders and len(holders) == 1):
                break
            matched, blocks = holders, i + 1
        candidates = range(len(self.tokens)) if matched is None else list(matched)
        candidates = [r for r in candidates if r != exclude and self.tokens[r]]
        done = blocks * BLOCK
        best, best_n = None, 0
        for r in candidates:  # then token by token inside the next block
            t = self.tokens[r]
            n = done + common_prefix(t[done:done + BLOCK], prompt[done:done + BLOCK], limit - done)
            if n > best_n:
                best, best_n = r, n
        if best is not None and self.tokens[best][:best_n] != prompt[:best_n]:
            return None, 0  # a hash collision: no hit rather than someone else's K/V
        return best, best_n

    def _keep_elsewhere(self, row: int, candidates: list[int]) -> None:
        """`row` is about to be overwritten: move what it holds to the emptiest / least recently
        used free row, if that row's own content is older."""
        if not self.enabled or not candidates:
            return
        target = min(candidates, key=lambda r: (bool(self.tokens[r]), self._used[r]))
        if self.tokens[target] and self._used[target] > self._used[row]:
            return
        self._copy(row, target, len(self.tokens[row]))
        self._set(target, self.tokens[row])
        self._used[target] = self._used[row]


class RowBackend:
    """The slot -> row bookkeeping every backend shares.  A subclass calls `_init_rows` and gives
    `_copy_rows(src, dst, n)` (dst holds src's first n positions, and nothing after them) and
    `_truncate(row, n)` (the row keeps its first n positions)."""

    rows: KVRows

    def _init_rows(self, n_rows: int, prefix_cache: bool) -> None:
        self.rows = KVRows(n_rows, self._copy_rows, enabled=prefix_cache)

    def start(self, slot: int, prompt_ids: list[int]) -> int:
        """Begin a new sequence in `slot`; returns how many prompt tokens are already cached."""
        row, n = self.rows.start(slot, list(prompt_ids))
        self._truncate(row, n)
        return n

    def reuse(self, slot: int, prompt_ids: list[int], have: int) -> int:
        return self.rows.reuse(slot, prompt_ids, have)

    def _row_for_prefill(self, slot: int, start: int) -> int:
        """The slot's row; a prefill at 0 of a slot not started begins a sequence with nothing cached."""
        if start == 0 and slot not in self.rows.row_of:
            row, _ = self.rows.start(slot, [])
            self._truncate(row, 0)
        row = self.rows.row_of[slot]
        if start > len(self.rows.tokens[row]):
            raise RuntimeError(f"slot {slot} holds {len(self.rows.tokens[row])} tokens: cannot write at {start}")
        return row

    def free(self, slot: int) -> None:
        self.rows.release(slot)

    def forget_prefixes(self) -> None:
        """Drop every finished sequence's tokens (a warm-up's are no prefix anyone asked for)."""
        self.rows.forget_all()

    def cached_tokens(self) -> int:
        return self.rows.held_tokens()

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens found in the cache) since start."""
        return self.rows.queried_tokens, self.rows.hit_tokens
