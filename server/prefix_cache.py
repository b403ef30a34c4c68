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
times), so unlike vLLM's paged blocks the cache shares nothing and copies instead.  Matching is a
scan over the rows (at most a few dozen): fine at this scale, where vLLM's block hashes pay off
at thousands of blocks.

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


class KVRows:
    def __init__(self, n_rows: int, copy: Callable[[int, int, int], None], enabled: bool = True):
        self.enabled = enabled
        self._copy = copy
        self.row_of: dict[int, int] = {}  # scheduler slot -> row of its live sequence
        self.tokens: list[list[int]] = [[] for _ in range(n_rows)]  # valid K/V per row, in position order
        self.live = [False] * n_rows
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
        self.tokens[row] = list(prompt[:n])
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
        self.tokens[row] = list(prompt[:n])
        self._touch(source)
        self.hit_tokens += n - have
        return n

    def written(self, row: int, ids: list[int], start: int) -> None:
        """The backend wrote `ids` at positions start.. of `row` (after its forward succeeded)."""
        t = self.tokens[row]
        if start != len(t):  # positions from `start` on were overwritten: no longer what t says
            del t[start:]
        t.extend(ids)

    def release(self, slot: int) -> int | None:
        """The slot's sequence ended (its row's tokens stay, to be matched); returns that row."""
        row = self.row_of.pop(slot, None)
        if row is not None:
            self.live[row] = False
            if not self.enabled:
                self.tokens[row] = []
        return row

    def forget_all(self) -> None:
        """Drop every finished row's tokens (live rows keep theirs) and the counters."""
        for r, live in enumerate(self.live):
            if not live:
                self.tokens[r] = []
        self.queried_tokens = self.hit_tokens = 0

    # ---- internals -----------------------------------------------------------------------------
    def _touch(self, row: int) -> None:
        self._used[row] = next(self._clock)

    def _best(self, prompt: list[int], exclude: int | None) -> tuple[int | None, int]:
        """(the row holding the longest prefix of prompt, its length), (None, 0) when none does."""
        limit = len(prompt) - 1
        if not self.enabled or limit <= 0:
            return None, 0
        best, best_n = None, 0
        for r, t in enumerate(self.tokens):
            if r == exclude or len(t) <= best_n:
                continue
            n = common_prefix(t, prompt, limit)
            if n > best_n:
                best, best_n = r, n
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
        self.tokens[target], self._used[target] = list(self.tokens[row]), self._used[row]


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

    def cached_tokens(self) -> int:
        return self.rows.held_tokens()

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, prompt tokens found in the cache) since start."""
        return self.rows.queried_tokens, self.rows.hit_tokens
