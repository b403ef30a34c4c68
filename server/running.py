"""A request while the scheduler runs it: its stream and slot, its sampler, and how far its prompt's
K/V and its output have come (the schedulers of scheduler.py and paged_scheduler.py share it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantserve.server.engine import TokenStream
from quantserve.server.sampling import SequenceSampler


@dataclass
class RunningSequence:
    """A request the scheduler has admitted: its stream, its slot, where its prompt and output stand."""
    stream: TokenStream
    slot: int
    sampler: SequenceSampler
    last_token: int
    generated: int
    submitted_at: float
    admitted_at: float = 0.0  # when it first took a slot: submitted_at..admitted_at is its time queued
    arrival: int = 0  # admission order: the newest sequence is the first preempted
    prefilled: int = 0  # tokens of `context()` whose K/V are in the cache
    cached: int = 0  # prompt tokens taken from the prefix cache instead of computed
    prompt_scores: list | None = None  # with prompt_logprobs: (token, logprob, top) per prompt token
    output_ids: list[int] = field(default_factory=list)  # tokens sampled so far

    @property
    def scoring(self) -> bool:
        """Its prompt's log-probabilities are wanted: every position computed, none from the cache."""
        return self.stream.request.params.prompt_logprobs is not None and not self.generated

    def context(self) -> list[int]:
        """The tokens whose K/V the next decode step needs: the prompt and every sampled token but
        the last (which that step feeds in)."""
        prompt = self.stream.request.prompt_ids
        return prompt + self.output_ids[:-1] if self.output_ids else prompt

    def context_len(self) -> int:
        return len(self.stream.request.prompt_ids) + max(self.generated - 1, 0)

    @property
    def ready(self) -> bool:
        """Its whole context is in the cache."""
        return self.ready_after(0)

    def ready_after(self, tokens: int) -> bool:
        """Its whole context is in the cache once `tokens` more are."""
        return self.prefilled + tokens == self.context_len()

    @property
    def decoding(self) -> bool:
        return self.generated > 0 and self.ready
