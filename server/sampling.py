"""Per-request sampling: penalties, temperature, top-k, top-p, seeded draws and logprobs.

Every running sequence carries its own `SamplingParams` (with, for structured output, its own
grammar `constraint`: tokens it forbids are masked to -inf first) and its own random generator, so a batch
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
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token and the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    embed: str | None = None  # an embedding request ("last" or "mean" pooling): no tokens generated
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    constraint: object | None = None  # a structured.Constraint: this sequence's grammar state

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class SequenceSampler:
    """Sampling state of one sequence: its generator and the counts of the tokens it has produced.

    Plain numpy on the CPU: sampling one row is a few vector operations either way, and the GGUF
    engine's process must not load torch (next to llama.cpp's CUDA build it crashes the process)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        import numpy as np

        self.params = params
        # any 64-bit seed the API accepts, negative ones included, names one stream
        self.generator = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.output_counts = np.zeros(vocab_size, dtype=np.float32) if params.penalised else None
        self.seen = np.zeros(vocab_size, dtype=bool) if params.repetition_penalty != 1.0 else None
        if self.seen is not None:
            self.seen[np.minimum(np.asarray(prompt_ids, dtype=np.int64), vocab_size - 1)] = True
        known = {t: b for t, b in params.logit_bias.items() if t < vocab_size}  # ids past the logits: no row
        self.bias_ids = np.fromiter(known, dtype=np.int64) if known else None
        self.bias = np.fromiter(known.values(), dtype=np.float32) if known else None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to compute: the token is the row's argmax, which the scheduler
        takes for the whole batch at once, where the logits are."""
        p = self.params
        return p.greedy and not p.penalised and not p.logit_bias and p.logprobs is None and p.constraint is None

    @property
    def masked_greedy(self) -> bool:
        """Greedy under a grammar and nothing else: the scheduler takes a masked argmax of the
        batch where the logits are, with only the grammar's bitmask sent there."""
        p = self.params
        return (p.constraint is not None and p.greedy and not p.penalised and not p.logit_bias
                and p.logprobs is None)

    def accept(self, token: int) -> None:
        """Record a token picked outside `sample` (a batch argmax, plain or masked)."""
        self._record(token)
        if self.params.constraint is not None:
            self.params.constraint.accept(token)

    def sample(self, logits):
        """Pick the next token from a 1-D logits row (numpy); returns (token, logprob, top list)."""
        import numpy as np

        p = self.params
        raw = np.asarray(logits, dtype=np.float32)
        scores = self._penalise(raw) if p.penalised else raw
        if self.bias_ids is not None:  # OpenAI's logit_bias: added before temperature and top-k/p
            scores = scores.copy() if scores is raw else scores
            scores[self.bias_ids] += self.bias
        if p.constraint is not None:  # structured output: only what the grammar allows next
            scores = np.where(p.constraint.mask(scores.size), scores, np.float32(-np.inf))
        if p.greedy:
            token = int(np.argmax(scores))
        else:
            with np.errstate(over="ignore", invalid="ignore"):  # overflowed scores: `_draw` copes
                scores = scores / np.float32(p.temperature)
                if p.top_k and 0 < p.top_k < scores.size:
                    kth = np.partition(scores, scores.size - p.top_k)[scores.size - p.top_k]
                    scores = np.where(scores < kth, np.float32(-np.inf), scores)
                if p.top_p < 1.0:
                    scores = _top_p_filter(scores, p.top_p)
                if p.min_p > 0.0:
                    # p(token) < min_p * p(best)  <=>  score < best + log(min_p)
                    scores = np.where(scores < np.max(scores) + np.float32(np.log(p.min_p)),
                                      np.float32(-np.inf), scores)
                token = _draw(scores, self.generator)
        self._record(token)
        if p.constraint is not None:
            p.constraint.accept(token)
        if p.logprobs is None:
            return token, None, None
        logprobs = _log_softmax(raw)
        top = []
        if p.logprobs > 0:
            k = min(p.logprobs, logprobs.size)
            ids = np.argpartition(-logprobs, k - 1)[:k] if k < logprobs.size else np.arange(logprobs.size)
            ids = ids[np.argsort(-logprobs[ids], kind="stable")]
            top = list(zip(ids.tolist(), logprobs[ids].tolist()))
        return token, float(logprobs[token]), top

    def _penalise(self, scores):
        import numpy as np

        p = self.params
        scores = scores.copy()
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if self.seen is not None:
                # CTRL / Hugging Face style: over prompt and output, shrink positive logits, grow negative ones
                s = scores[self.seen]
                scores[self.seen] = np.where(s < 0, s * np.float32(p.repetition_penalty),
                                             s / np.float32(p.repetition_penalty))
            if self.output_counts is not None:
                # OpenAI style: over generated tokens only
                scores -= np.float32(p.frequency_penalty) * self.output_counts
                scores -= np.float32(p.presence_penalty) * (self.output_counts > 0)
        # a tiny repetition penalty divides by ~0: keep overflowed scores finite (and ordered)
        return np.where(np.isnan(scores), np.float32(-np.inf), scores).astype(np.float32)

    def _record(self, token: int) -> None:
        if self.output_counts is not None and token < self.output_counts.size:
            self.output_counts[token] += 1
        if self.seen is not None and token < self.seen.size:
            self.seen[token] = True


def score_tokens(logits, targets: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """(logprob of targets[i] under logits row i, the top k of that row) for each row: the
    prompt's log-probabilities (`echo` with `logprobs`: log-likelihood evaluation)."""
    import numpy as np

    rows = np.asarray(logits.numpy() if hasattr(logits, "numpy") else logits, dtype=np.float32)
    out = []
    for row, target in zip(rows, targets):
        lp = _log_softmax(row)
        top = []
        if k > 0:
            ids = np.argpartition(-lp, min(k, lp.size) - 1)[:k] if k < lp.size else np.arange(lp.size)
            ids = ids[np.argsort(-lp[ids], kind="stable")]
            top = list(zip(ids.tolist(), lp[ids].tolist()))
        out.append((float(lp[target]), top))
    return out


def masked_argmax(logits, rows: list[int], bitmasks) -> list[int]:
    """argmax of `logits[rows]` over the tokens each row's bitmask allows (int32 words, bit i of
    word w = token 32 w + i; `structured.Constraint.bitmask`).  On a torch tensor the masks are
    unpacked on its device: 4 bytes per 32 tokens travel there instead of a whole row of logits
    coming back (at 128k logits and 32 rows, 16 MB a step).  Numpy logits (gguf) stay numpy."""
    import numpy as np

    width = logits.shape[-1]
    if type(logits).__module__.startswith("torch"):
        import torch

        words = torch.from_numpy(np.ascontiguousarray(bitmasks)).to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
        allowed = _fit(allowed, width, lambda n: torch.zeros(len(rows), n, dtype=torch.bool, device=logits.device),
                       torch.cat)
        picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        return picked.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()
    allowed = np.unpackbits(np.ascontiguousarray(bitmasks).view(np.uint8), axis=-1, bitorder="little").astype(bool)
    allowed = _fit(allowed, width, lambda n: np.zeros((len(rows), n), dtype=bool), np.concatenate)
    picked = np.asarray(logits)[rows]
    return np.where(allowed, picked, -np.inf).argmax(-1).tolist()


def _fit(allowed, width: int, zeros, cat):
    """Cut or pad (with "not allowed") a [rows, 32 x words] mask to the logits' width."""
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return cat([allowed, zeros(width - allowed.shape[1])], 1)


def _log_softmax(x):
    import numpy as np

    shifted = x.astype(np.float64) - np.max(x)
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


def _softmax(x):
    import numpy as np

    e = np.exp(x.astype(np.float64) - np.max(x))
    return e / e.sum()


def _draw(scores, generator) -> int:
    """One token from softmax(scores); never fails on overflowed scores.

    Penalties and temperature can push scores to +-inf (or NaN for inf - inf); softmax then gives
    NaN.  +inf becomes the largest float (those tokens share the mass), NaN and -inf get no mass;
    when nothing is left, the best score wins.
    """
    import numpy as np

    if not np.isfinite(scores).all():
        scores = np.nan_to_num(scores, nan=-np.inf, posinf=np.finfo(np.float32).max, neginf=-np.inf)
        if np.isneginf(scores).all():
            return int(np.argmax(scores))
    probs = _softmax(scores)
    cdf = np.cumsum(probs)
    # inverse CDF: the first token whose cumulative mass passes a uniform draw (never a zero-mass one)
    i = int(np.searchsorted(cdf, generator.random() * cdf[-1], side="right"))
    return i if i < probs.size and probs[i] > 0 else int(np.flatnonzero(probs)[-1])


def _top_p_filter(scores, top_p: float):
    import numpy as np

    order = np.argsort(-scores, kind="stable")
    probs = _softmax(scores[order])
    # drop a token when the tokens before it already reach top_p; the first token always stays
    # (set explicitly: a top_p that rounds to 0 in float32 would otherwise drop it too)
    drop_sorted = (np.cumsum(probs) - probs) >= top_p
    drop_sorted[0] = False
    drop = np.empty_like(drop_sorted)
    drop[order] = drop_sorted
    return np.where(drop, np.float32(-np.inf), scores)
