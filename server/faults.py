"""Fault injection for the reliability tests, installed where the engine is assembled (engines.py).

Running out of memory is tested for real (a server under an address-space limit); nothing else
makes a decode step fail on demand, yet the reply path of every other failure (a 500, or an
error event in a stream) must be proved too.
"""

from __future__ import annotations

import os

FAULT_ENV = "QUANTSERVE_FAULT_DECODE_STEPS"


class FaultyDecode:
    """Fault injection for the reliability tests: with QUANTSERVE_FAULT_DECODE_STEPS="3,9" the 3rd
    and 9th decode steps (counted from 1, failed ones included) raise RuntimeError.

    Running out of memory is tested for real (a server under an address-space limit); nothing
    else makes a decode step fail on demand, yet the reply path of every other failure (a 500, or
    an error event in a stream) must be proved too.  Unset, the backend is used as it is."""

    def __init__(self, backend, steps: str):
        self._backend, self._fail_at, self._step = backend, {int(x) for x in steps.split(",") if x.strip()}, 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def _count(self) -> None:
        self._step += 1
        if self._step in self._fail_at:
            raise RuntimeError(f"injected fault: decode step {self._step} failed")

    def decode(self, slots, tokens):
        self._count()
        return self._backend.decode(slots, tokens)

    def step(self, items):
        """A paged backend's forward (decodes and prompt pieces together) counts as a decode step."""
        self._count()
        return self._backend.step(items)


def with_faults(backend):
    """`backend`, wrapped to fail the decode steps $QUANTSERVE_FAULT_DECODE_STEPS names; unset, itself."""
    steps = os.environ.get(FAULT_ENV)
    return FaultyDecode(backend, steps) if steps else backend
