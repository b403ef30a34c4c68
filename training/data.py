"""Training data: JSONL of `{"text": ...}` or chat `{"messages": [...]}` into token ids and labels.

Chat records are rendered with the tokenizer's own chat template; only assistant turns carry a
loss (every other label is -100), so the model learns to answer, not to predict user prompts.
The assistant spans are found by rendering the conversation prefix by prefix and mapping the
character spans to tokens with the fast tokenizer's offsets, which works for any template that
renders a prefix of the conversation as a prefix of the text (ChatML, Llama-3, Mistral, ...).

Bad lines are reported with their line numbers and stop the run, unless `skip_bad_lines`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from quantserve.settings import UserError

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Record:
    line: int
    text: str | None = None
    messages: list[dict] | None = None


def read_jsonl(path: Path, skip_bad_lines: bool = False, what: str = "training") -> list[Record]:
    """Parse and check every line; a bad line is an error naming it (or a warning when skipping).
    `what` the records are for, in the errors: "training" (--data) or "evaluation" (--eval-data,
    which --skip-bad-lines does not cover)."""
    records, bad = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(_parse(line, n))
        except ValueError as e:
            bad.append(f"line {n}: {e}")
    if bad and not skip_bad_lines:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        remedy = "fix them or pass --skip-bad-lines" if what == "training" else "fix them"
        raise UserError(f"{path}: {len(bad)} malformed line(s): {'; '.join(bad[:3])}{more}; {remedy}")
    for msg in bad:
        print(f"warning: {path}: skipped {msg}", file=sys.stderr)
    if not records:
        raise UserError(f"{path}: no {what} records (the file is empty or every line was bad)")
    return records


def _parse(line: str, n: int) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'text' or 'messages'")
    if "messages" in obj and "text" in obj:  # which one to train on would be a guess
        raise ValueError("both 'text' and 'messages': ambiguous, give one of them")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise ValueError(f"message {i} needs a 'role' in {ROLES} and a string 'content'")
        if msgs[0]["role"] == "assistant":  # its loss span would start at an empty conversation
            raise ValueError("the first message is the assistant's: a system or user message must come before it")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError("no assistant message: nothing to learn from")
        return Record(n, messages=msgs)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"].strip():
            raise ValueError("'text' must be a non-empty string")
        return Record(n, text=obj["text"])
    raise ValueError("expected a 'text' or a 'messages' field")


def encode_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels that keep only assistant turns."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat records need a tokenizer with a chat template; this one has none")
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
        if not full.startswith(render(messages[: i + 1], False)):
            raise UserError("the chat template does not render conversation prefixes as text prefixes; "
                            "assistant-only loss cannot be located")
        spans.append((start, end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [IGNORE] * len(ids)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        # A token belongs to an assistant turn when it starts inside one of the spans.
        if any(s <= a < e for s, e in spans) and b > a:
            labels[t] = ids[t]
    return ids, labels


def encode_text(tokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return ids, list(ids)


def encode(tokenizer, records: list[Record], seq_len: int, packing: bool) -> list[dict]:
    """Examples of `input_ids`/`labels`, each at most `seq_len` tokens.

    Without packing, a longer example is an error naming its line (truncating it would cut off
    the very answer the loss is on).  With packing, examples are concatenated and cut into
    `seq_len` blocks (`pack`).
    """
    examples = []
    too_long = []
    for r in records:
        ids, labels = encode_chat(tokenizer, r.messages) if r.messages else encode_text(tokenizer, r.text)
        if all(lab == IGNORE for lab in labels):
            continue
        if len(ids) > seq_len and not packing:
            too_long.append(f"line {r.line} ({len(ids)} tokens)")
        examples.append({"input_ids": ids, "labels": labels})
    if too_long:
        raise UserError(f"{len(too_long)} example(s) longer than --seq-len {seq_len}: "
                        f"{', '.join(too_long[:3])}; raise --seq-len or use --packing")
    if not examples:
        raise UserError("no example has a token to learn from")
    return pack(examples, seq_len) if packing else examples


def pack(examples: list[dict], seq_len: int) -> list[dict]:
    """The examples end to end, cut into `seq_len` blocks, each token with its position in its
    example (from 0 again where a block cuts one): transformers reads the example boundaries from
    the positions and masks attention across them, so no example attends to another (what
    LLaMA-Factory calls neat packing). No position predicts an example's first token."""
    ids, labels, starts = [], [], []
    for e in examples:
        ids += e["input_ids"]
        labels += [IGNORE] + e["labels"][1:]
        starts += [True] + [False] * (len(e["input_ids"]) - 1)
    blocks = []
    for b in range(max(1, len(ids) // seq_len)):
        cut = slice(b * seq_len, (b + 1) * seq_len)
        positions: list[int] = []
        for first in starts[cut]:
            positions.append(0 if first or not positions else positions[-1] + 1)
        blocks.append({"input_ids": ids[cut], "labels": labels[cut], "position_ids": positions})
    return blocks


class Collator:
    """Turns a list of examples into one micro-batch; the loss is on `labels`, never on padding.

    Two layouts, the same loss:
    - padded: right-padded to the longest example (a multiple of 8, for tensor cores) with an
      attention mask;
    - flat (padding-free): the examples end to end in one row, positions restarting at each one
      (transformers' `DataCollatorWithFlattening`). transformers builds the attention mask from
      those positions, so no example sees another, and no pad token is computed.
    With `padding_free`, each batch takes the cheaper layout (`flat_is_cheaper`). On the default
    task, where a fifth of the examples are 3x the median length, padding made 3.2x the real tokens.
    """

    def __init__(self, pad_id: int, max_len: int, multiple_of: int = 8, padding_free: bool = False,
                 hidden_size: int = 0, attention: str = "sdpa"):
        """attention: the model's implementation (transformers' name), which `flat_is_cheaper` weighs."""
        self.pad_id, self.max_len, self.multiple_of = pad_id, max_len, multiple_of
        self.padding_free, self.hidden_size, self.attention = padding_free, hidden_size, attention
        self.seen: list[int] | None = None  # example indices, when auditing the data sharding
        self._flatten = None

    def __call__(self, batch: list[dict]) -> dict:
        if self.seen is not None:
            self.seen.extend(e["idx"] for e in batch)
        if "position_ids" in batch[0]:
            return self._packed(batch)
        lengths = [len(e["input_ids"]) for e in batch]
        if self.padding_free and flat_is_cheaper(lengths, self.hidden_size, self.attention):
            return self._flat(batch)
        return self._padded(batch)

    def _flat(self, batch: list[dict]) -> dict:
        if self._flatten is None:
            from transformers import DataCollatorWithFlattening

            self._flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=IGNORE)
        # the separator replaces each example's first label, which no position predicts anyway
        flat = self._flatten([{"input_ids": e["input_ids"], "labels": e["labels"]} for e in batch])
        # transformers reads the example boundaries from the positions only when no KV cache is kept
        return {**flat, "use_cache": False}

    def _packed(self, batch: list[dict]) -> dict:
        """Packed blocks (`pack`), all of one length: their positions carry the examples' bounds.
        flash-attention reads bounds from positions only in a batch of one row: the blocks are laid
        end to end for it (each block starts at position 0, so a block is never joined to another)."""
        import torch

        out = {key: torch.tensor([e[key] for e in batch], dtype=torch.long)
               for key in ("input_ids", "labels", "position_ids")}
        if self.attention == VARLEN_ATTENTION:
            out = {key: t.reshape(1, -1) for key, t in out.items()}
        return {**out, "use_cache": False}

    def _padded(self, batch: list[dict]) -> dict:
        import torch

        n = max(len(e["input_ids"]) for e in batch)
        n = max(n, min(self.max_len, -(-n // self.multiple_of) * self.multiple_of))
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, e in enumerate(batch):
            k = len(e["input_ids"])
            ids[i, :k] = torch.tensor(e["input_ids"])
            labels[i, :k] = torch.tensor(e["labels"])
            mask[i, :k] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


# A flat row's mask is dense (rows x rows): past this many tokens it costs more memory than a batch
# is worth, so such a batch is padded instead.
MAX_FLAT_TOKENS = 8192
VARLEN_ATTENTION = "flash_attention_2"  # takes rows of several sequences without a mask


def flat_is_cheaper(lengths: list[int], hidden_size: int, attention: str = "sdpa") -> bool:
    """Whether a batch of these example lengths costs fewer FLOPs flat than padded.

    Per layer, the linear layers cost ~24 h^2 per token computed (q/k/v/o and a 4h MLP, forward),
    and attention ~4 h per query-key pair it scores. Padded scores B x L^2 pairs on B x L tokens;
    flat scores T^2 pairs (a dense mask) on T = sum(lengths) tokens, except with flash-attention's
    variable-length rows, which score only each example's own pairs. Eager attention keeps every
    score in memory, so there a flat row may not score more pairs than the padded batch.
    """
    n, longest = sum(lengths), max(lengths)
    varlen = attention == VARLEN_ATTENTION
    if len(lengths) < 2 or (n > MAX_FLAT_TOKENS and not varlen):
        return False  # one example has no padding to save; a long flat row's dense mask is too big
    padded_pairs = len(lengths) * longest * longest
    flat_pairs = sum(k * k for k in lengths) if varlen else n * n
    if attention == "eager" and flat_pairs > padded_pairs:
        return False
    linear, pair = 24 * hidden_size**2, 4 * hidden_size
    return n * linear + flat_pairs * pair < len(lengths) * longest * linear + padded_pairs * pair


class TokenDataset:
    """A list of encoded examples as a map-style dataset (the Trainer's sampler shards it)."""

    def __init__(self, examples: list[dict]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        return {**self.examples[i], "idx": i}

    def tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)
