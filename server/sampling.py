"""Per-request sampling: penalties, temperature, top-k, top-p, seeded draws and logprobs.

Every running sequence carries its own `SamplingParams` and its own `torch.Generator`, so a batch
can mix greedy and sampled requests, and a seeded request gives the same tokens whatever else is
in the batch.  Logprobs are those of the model's raw distribution (log-softmax of the logits,
before penalties and temperature), like vLLM's default: they are the model's probabilities, which
is what a client checking them expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample like greedy decoding (vLLM's _SAMPLING_EPS): dividing logits by a
# tiny temperature overflows to infinity, and softmax over infinities is NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token and the top k
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class SequenceSampler:
    """Sampling state of one sequence: its generator and the counts of the tokens it has produced."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        import torch

        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.output_counts = torch.zeros(vocab_size) if params.penalised else None
        self.seen = torch.zeros(vocab_size, dtype=torch.bool) if params.repetition_penalty != 1.0 else None
        if self.seen is not None:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long).clamp(max=vocab_size - 1)] = True

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to compute: the token is the row's argmax, which the scheduler
        takes for the whole batch at once, where the logits are."""
        return self.params.greedy and not self.params.penalised and self.params.logprobs is None

    def accept(self, token: int) -> None:
        """Record a token picked outside `sample` (a plain-greedy batch argmax)."""
        self._record(token)

    def sample(self, logits):
        """Pick the next token from a 1-D float32 logits row; returns (token, logprob, top list)."""
        import torch

        p = self.params
        raw = logits.float()
        scores = self._penalise(raw) if p.penalised else raw
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            scores = scores / p.temperature
            if p.top_k and p.top_k > 0 and p.top_k < scores.numel():
                kth = torch.topk(scores, p.top_k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if p.top_p < 1.0:
                scores = _top_p_filter(scores, p.top_p)
            token = _draw(scores, self.generator)
        self._record(token)
        if p.logprobs is None:
            return token, None, None
        logprobs = torch.log_softmax(raw, dim=-1)
        top = []
        if p.logprobs > 0:
            values, ids = torch.topk(logprobs, min(p.logprobs, logprobs.numel()))
            top = list(zip(ids.tolist(), values.tolist()))
        return token, float(logprobs[token]), top

    def _penalise(self, scores):
        import torch

        p = self.params
        scores = scores.clone()
        if self.seen is not None:
            # CTRL / Hugging Face style: over prompt and output, shrink positive logits, grow negative ones
            s = scores[self.seen]
            scores[self.seen] = s.where(s < 0, s / p.repetition_penalty).where(s >= 0, s * p.repetition_penalty)
        if self.output_counts is not None:
            # OpenAI style: over generated tokens only
            scores -= p.frequency_penalty * self.output_counts
            scores -= p.presence_penalty * (self.output_counts > 0).float()
        # a tiny repetition penalty divides by ~0: keep overflowed scores finite (and ordered)
        return torch.nan_to_num(scores, nan=float("-inf"))

    def _record(self, token: int) -> None:
        if self.output_counts is not None and token < self.output_counts.numel():
            self.output_counts[token] += 1
        if self.seen is not None and token < self.seen.numel():
            self.seen[token] = True


def _draw(scores, generator) -> int:
    """One token from softmax(scores); never fails on overflowed scores.

    Penalties and temperature can push scores to +-inf (or NaN for inf - inf); softmax then gives
    NaN and `multinomial` raises.  +inf becomes the largest float (those tokens share the mass),
    NaN and -inf get no mass; when nothing is left, the best score wins.
    """
    import torch

    if not bool(torch.isfinite(scores).all()):
        scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=torch.finfo(scores.dtype).max)
        if bool(torch.isneginf(scores).all()):
            return int(torch.argmax(scores))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p_filter(scores, top_p: float):
    import torch

    sorted_scores, order = torch.sort(scores, descending=True)
    cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
    # drop a token when the tokens before it already reach top_p; the first token always stays
    # (set explicitly: a top_p that rounds to 0 in float32 would otherwise drop it too)
    drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))
