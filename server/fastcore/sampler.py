"""Batched sampling with per-request settings: temperature, top-k, top-p, penalties, seed.

One vectorised pass over the [n, vocab] logits of a decode step.  Randomness comes from a
per-request `torch.Generator` on the CPU that draws one uniform number per token; the token is
then picked by inverse CDF on the GPU.  So a seeded request gives the same tokens whatever else
shares its batch, and no per-row kernel launches are needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face semantics, over prompt + generated tokens
    seed: int | None = None
    generator: torch.Generator = field(default=None, repr=False)

    def __post_init__(self):
        if self.generator is None:
            self.generator = torch.Generator()
            if self.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.seed)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    n, V = logits.shape
    if not any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        return logits
    dev = logits.device
    counts = torch.zeros(n, V, device=dev)
    seen = torch.zeros(n, V, dtype=torch.bool, device=dev)
    for i, (pr, out) in enumerate(zip(prompts, outputs)):
        if out:
            o = torch.tensor(out, device=dev)
            counts[i].index_add_(0, o, torch.ones(len(out), device=dev))
        if pr or out:
            seen[i, torch.tensor(list(pr) + list(out), device=dev, dtype=torch.long)] = True
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    logits = logits - pres * (counts > 0) - freq * counts
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen, penalised, logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None) -> list[int]:
    """logits [n, vocab] (float32) -> one token id per row."""
    n = logits.shape[0]
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    logits = apply_penalties(logits.float(), params, prompts, outputs)
    greedy = logits.argmax(dim=-1)
    if all(p.temperature <= 0 for p in params):
        return greedy.tolist()
    dev = logits.device
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=dev)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    cum = sorted_p.cumsum(dim=-1)
    # keep a token while the mass before it is < top_p (the first token is always kept)
    keep = (rank < top_k) & ((cum - sorted_p) < top_p)
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=p.generator) for p in params]).to(dev)[:, None]
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=logits.shape[1] - 1)
    sampled = order.gather(1, pick)[:, 0]
    is_greedy = torch.tensor([p.temperature <= 0 for p in params], device=dev)
    return torch.where(is_greedy, greedy, sampled).tolist()
