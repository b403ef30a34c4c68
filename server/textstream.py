"""From generated token ids to the text a client sees: incremental detokenization and stop strings.

- Decoding token by token breaks multi-byte characters (U+FFFD halves); `IncrementalDetokenizer`
  releases text only once it no longer ends in U+FFFD: through the Rust tokenizer's own
  incremental decoder where the tokenizer offers one (`decode_stream`: ~1 µs a token, where two
  window decodes through transformers took ~7), else by decoding a small window (vLLM's method).
- Stop strings are never emitted, even when split across tokens: `StopMatcher` holds back the
  longest tail of the text that could still become a stop string, and cuts at the first match.
- `ChoiceText` ties both together for one choice and pairs each released piece of text with the
  logprob entries of the tokens that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantserve.server.engine import ModelTokenizer, TokenEvent


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int]):
        self._decode = tokenizer.decode
        # a few prompt tokens as context, so the first generated token decodes as it would in place
        self._ids = list(prompt_ids[-4:])
        self._prefix = 0
        self._read = len(self._ids)
        stream = getattr(tokenizer, "decode_stream", None)
        self._step = stream(self._ids) if stream is not None else None

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._step is not None:
            text = self._step(token_id)
            if text is None:  # an incomplete character: held (flush decodes what is held)
                return ""
            self._prefix, self._read = self._read, len(self._ids)
            return text
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character stays as U+FFFD)."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[:min(hits)], True
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _held_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


@dataclass
class LogprobEntry:
    token: str
    token_bytes: list[int]
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)
    top: list[tuple[str, list[int], float]]
    # characters of text before this token: from the prompt's start for a prompt token, from the
    # generated text's start for a generated one (special tokens add none: they are not in the text)
    offset: int = 0


@dataclass
class Delta:
    text: str
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None

    def then(self, later: "Delta") -> "Delta":
        """This delta and a later one of the same choice as one."""
        return Delta(self.text + later.text, self.logprobs + later.logprobs, later.finish_reason)


class ChoiceText:
    """One choice's text as it grows; `push(event)` returns what to send for that event."""

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int], stop: list[str], want_logprobs: bool,
                 end_token_logprobs: bool = False, kept_tokens: dict[int, str] | None = None):
        """kept_tokens: special token ids whose text the reply keeps (decoding leaves special tokens
        out): a tool-call format's marker, which its parser reads."""
        self.tokenizer = tokenizer
        self.kept_tokens = kept_tokens or {}
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopMatcher(stop)
        self.want_logprobs = want_logprobs
        # completions list the end token's logprob too (an evaluation harness counts on one entry per
        # generated token); chat's logprobs cover the content only, as OpenAI's do
        self.end_token_logprobs = end_token_logprobs
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine took from its prefix cache
        self.prompt_logprobs: list[LogprobEntry] = []  # when asked for (echo with logprobs)
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.all_logprobs: list[LogprobEntry] = []  # every released entry, for non-streaming replies
        self._waiting_logprobs: list[LogprobEntry] = []  # tokens whose text is not released yet
        self._decoded = 0  # characters the detokenizer has given so far (before stop strings cut)
        self.prompt_text: str | None = None  # the prompt as the client wrote it, where it is echoed

    def push(self, event: TokenEvent) -> Delta:
        text = ""
        if event.cached_tokens is not None:
            self.cached_tokens = event.cached_tokens
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = self._prompt_entries(event.prompt_logprobs)
        if event.token_id is not None:
            self.completion_tokens += 1
            at = self._decoded
            is_end_token = event.finish_reason == "stop"  # eos / stop token ids are not text
            if not is_end_token:
                text = self.detok.push(event.token_id) + self.kept_tokens.get(event.token_id, "")
            if self.want_logprobs and (self.end_token_logprobs or not is_end_token):
                self._waiting_logprobs.append(self._scored(event.token_id, event.logprob, event.top_logprobs or [], at))
        if event.finish_reason is not None:
            text += self.detok.flush()
        self._decoded += len(text)
        out, hit = self.stop.push(text)
        if hit:
            self.finish_reason = "stop"
        elif event.finish_reason is not None:
            out += self.stop.flush()
            # the engine's "cancelled" (shutdown) is vLLM's "abort"; "error" is turned into an error reply
            self.finish_reason = {"cancelled": "abort"}.get(event.finish_reason, event.finish_reason)
            self.error = event.error
        logprobs = []
        if out or self.finish_reason:
            logprobs, self._waiting_logprobs = self._waiting_logprobs, []
        self.text += out
        self.all_logprobs += logprobs
        return Delta(out, logprobs, self.finish_reason)

    def _prompt_entries(self, scored) -> list[LogprobEntry]:
        """The prompt's tokens with their logprobs, each at its offset in the prompt's text (decoded
        token by token, as the text a client sent decodes).  A special token takes room only where
        the client's text holds it (a BOS the tokenizer adds is not in it)."""
        detok, at, entries = IncrementalDetokenizer(self.tokenizer, []), 0, []
        text = self.prompt_text
        for token_id, logprob, top in scored:
            entries.append(self._scored(token_id, logprob, top, at))
            piece = detok.push(token_id)
            if not piece and text is not None:
                written = self.tokenizer.token_text(token_id)
                if written and text.startswith(written, at):
                    piece = written
            at += len(piece)
        return entries

    def _scored(self, token_id: int, logprob: float | None, top, offset: int) -> LogprobEntry:
        tok = self.tokenizer
        alternatives = [(tok.token_text(t.token_id), list(tok.token_bytes(t.token_id)), t.logprob) for t in top]
        return LogprobEntry(tok.token_text(token_id), list(tok.token_bytes(token_id)), logprob, alternatives, offset)
