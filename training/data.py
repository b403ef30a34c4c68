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


def read_jsonl(path: Path, skip_bad_lines: bool = False) -> list[Record]:
    """Parse and check every line; a bad line is an error naming it (or a warning when skipping)."""
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
        raise UserError(f"{path}: {len(bad)} malformed line(s): {'; '.join(bad[:3])}{more}; "
                        "fix them or pass --skip-bad-lines")
    for msg in bad:
        print(f"warning: {path}: skipped {msg}", file=sys.stderr)
    if not records:
        raise UserError(f"{path}: no training records (the file is empty or every line was bad)")
    return records


def _parse(line: str, n: int) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'text' or 'messages'")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise ValueError(f"message {i} needs a 'role' in {ROLES} and a string 'content'")
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
    `seq_len` blocks (cross-example attention is accepted, as in most packing recipes).
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
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    n = max(1, len(ids) // seq_len)
    return [{"input_ids": ids[i * seq_len:(i + 1) * seq_len], "labels": labels[i * seq_len:(i + 1) * seq_len]}
            for i in range(n)]


class Collator:
    """Right-pads a batch; padding is masked out of attention and loss.

    The transformers model shifts labels itself, so labels align with input_ids here.
    """

    def __init__(self, pad_id: int, max_len: int, multiple_of: int = 8):
        self.pad_id, self.max_len, self.multiple_of = pad_id, max_len, multiple_of
        self.seen: list[int] | None = None  # example indices, when auditing the data sharding

    def __call__(self, batch: list[dict]) -> dict:
        import torch

        if self.seen is not None:
            self.seen.extend(e["idx"] for e in batch)
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
