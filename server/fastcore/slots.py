"""The KV cache's slots: which are free, and how long each one's sequence is.

FastCore's cache holds `max_slots` sequences, one per slot (model.py).  `SlotTable` is the one
record of which slots hold a live sequence and how many of their positions are written: FastCore
updates it after each prefill, decode and copy, and the server's adapter reads a slot's length
from it for that slot's next decode position.

Slots are handed out lowest-first: a decode step runs over the slots 0..max(live slot), so
compact slots keep the padded batch small.
"""

from __future__ import annotations


class SlotTable:
    def __init__(self, n_slots: int):
        self.in_use = [False] * n_slots
        self.lengths = [0] * n_slots  # positions written; the next token goes at this one

    def free(self) -> list[int]:
        return [i for i, used in enumerate(self.in_use) if not used]

    def acquire(self) -> int:
        """The lowest free slot (keeps active slots compact, so decode batches stay small)."""
        free = self.free()
        if not free:
            raise RuntimeError("no free KV-cache slot")
        self.occupy(free[0], 0)
        return free[0]

    def occupy(self, slot: int, length: int) -> None:
        """`slot` holds a live sequence whose first `length` positions are in the cache."""
        self.in_use[slot] = True
        self.lengths[slot] = length

    def release(self, slot: int) -> None:
        """The slot's sequence is over (its K/V stay where they are: a prefix cache may copy them)."""
        self.in_use[slot] = False
        self.lengths[slot] = 0

    def held_tokens(self) -> int:
        """Positions written across the live sequences."""
        return sum(self.lengths)
