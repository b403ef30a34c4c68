"""The tokenizer half of a GGUF file: tokens, types, merges, special ids and the chat template.

llama.cpp re-implements the tokenizer from this metadata, so everything that decides token ids
must be carried over.  Two kinds:
- byte-level BPE (Llama 3, Qwen2, GPT-2; `tokenizer.ggml.model = gpt2`): the vocabulary and merges,
  and which pre-tokenizer regex splits the text first (`tokenizer.ggml.pre`, a name llama.cpp knows);
- SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma; `tokenizer.ggml.model = llama`):
  the pieces, their scores (llama.cpp merges the highest-scoring pair first), byte pieces typed as
  such, and whether a '▁' goes before the text.
For both: which added tokens are control tokens (parsed from text only when asked), and whether a
BOS is prepended.  Tests compare the ids with the Hugging Face tokenizer's (and SentencePiece's own)
on tricky strings.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from quantserve.settings import UserError

# Pre-tokenizer split regexes → the `tokenizer.ggml.pre` name llama.cpp uses for them.
# (convert_hf_to_gguf.py identifies these by hashing a tokenization; we read the regex itself.)
KNOWN_SPLIT_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def pre_tokenizer_name(tokenizer_json: dict, folder: Path) -> str:
    """The llama.cpp pre-tokenizer matching this Hugging Face byte-level BPE, or a clear error."""
    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{folder}: only BPE tokenizers convert to GGUF, byte-level or SentencePiece with "
                        f"byte fallback (tokenizer.json model is {model.get('type')!r})")
    # GPT-2 style: a single ByteLevel pre-tokenizer that applies the GPT-2 regex itself.
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        if pre.get("add_prefix_space"):
            raise UserError(f"{folder}: ByteLevel with add_prefix_space is not supported for GGUF")
        return "gpt-2"
    # Llama-3 / Qwen2 style: Split(regex) followed by ByteLevel(use_regex=false).
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers") or []
        splits = [s for s in steps if s.get("type") == "Split"]
        if len(splits) == 1 and steps[-1].get("type") == "ByteLevel":
            regex = (splits[0].get("pattern") or {}).get("Regex")
            if regex in KNOWN_SPLIT_REGEXES:
                return KNOWN_SPLIT_REGEXES[regex]
    raise UserError(f"{folder}: tokenizer pre-tokenizer {pre.get('type')!r} is not one llama.cpp "
                    "is known to reproduce (supported: GPT-2 byte-level, Llama-3, Qwen2)")


def is_sentencepiece_style(tokenizer_json: dict) -> bool:
    """A SentencePiece BPE vocabulary as transformers converts it (Llama 2, Mistral, Gemma): BPE
    over '▁'-marked text with byte fallback (<0x00>..<0xFF> pieces), not byte-level BPE."""
    model = tokenizer_json.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def add_space_prefix(tokenizer_json: dict) -> bool:
    """Whether the tokenizer puts '▁' before the text (SentencePiece's dummy prefix): a Metaspace
    pre-tokenizer that prepends, or a normalizer that prepends '▁' (Llama 2's form)."""
    def steps(node: dict | None, key: str) -> list[dict]:
        if not node:
            return []
        return node.get(key) or [] if node.get("type") == "Sequence" else [node]

    for step in steps(tokenizer_json.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") in ("first", "always"):
            return True
    for step in steps(tokenizer_json.get("normalizer"), "normalizers"):
        if step.get("type") == "Prepend" and step.get("prepend") == "\u2581":
            return True
    return False


def sentencepiece_scores(folder: Path, by_id: dict[int, str], merges: list) -> tuple[list[float], str]:
    """Each piece's score, which llama.cpp's SentencePiece tokenizer merges by (highest first):
    SentencePiece's own from tokenizer.model where the checkpoint has one; otherwise minus the rank
    of the BPE merge that makes the piece, which orders merges as transformers applies them."""
    model_file = folder / "tokenizer.model"
    if model_file.is_file():
        try:
            import sentencepiece
        except ImportError as e:
            raise UserError(f"{folder}: reading tokenizer.model needs the sentencepiece package "
                            "(pip install sentencepiece)") from e
        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        return [sp.get_score(i) if i < sp.get_piece_size() else 0.0 for i in range(max(by_id) + 1)], "tokenizer.model"
    rank = {}
    for r, m in enumerate(merges):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(left + right, r)
    return [-float(rank[by_id[i]]) if i in by_id and by_id[i] in rank else 0.0
            for i in range(max(by_id) + 1)], "merge ranks"


def add_tokenizer(writer, folder: Path, n_vocab: int) -> dict:
    """Write the tokenizer metadata of checkpoint `folder` into `writer`; return a summary."""
    import gguf
    from transformers import AutoTokenizer

    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{folder}: no tokenizer.json (a fast tokenizer is required for GGUF: "
                        "byte-level BPE, or SentencePiece BPE with byte fallback)")
    try:
        tokenizer_json = json.loads(tok_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{tok_file}: not valid JSON ({e})") from e
    spm = is_sentencepiece_style(tokenizer_json)
    pre = "default" if spm else pre_tokenizer_name(tokenizer_json, folder)

    tok = AutoTokenizer.from_pretrained(str(folder))
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder  # id → AddedToken, for special and user-added tokens
    if len(by_id) > n_vocab:
        raise UserError(f"{folder}: tokenizer has {len(by_id)} tokens but the model's embedding "
                        f"has only {n_vocab} rows")
    tokens, types = _tokens_and_types(by_id, added, n_vocab, tokenizer_json, spm)
    writer.add_tokenizer_model("llama" if spm else "gpt2")  # llama.cpp's names: SentencePiece, byte-level BPE
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    summary = {}
    if spm:
        merges = (tokenizer_json.get("model") or {}).get("merges") or []
        scores, source = sentencepiece_scores(folder, by_id, merges)
        writer.add_token_scores((scores + [0.0] * n_vocab)[:n_vocab])
        writer.add_add_space_prefix(add_space_prefix(tokenizer_json))
        summary = {"scores_from": source, "add_space_prefix": add_space_prefix(tokenizer_json)}
    # Merges, bos/eos/pad/unk ids, add_bos (parsed from the post-processor) and the chat template.
    # SpecialVocab warns about the pair template ("A <s> B"), which llama.cpp never uses.
    vocab_log = logging.getLogger("gguf.vocab")
    level, vocab_log.level = vocab_log.level, logging.ERROR
    try:
        # SentencePiece vocabularies merge by score, not by a merge list
        special = gguf.SpecialVocab(folder, load_merges=not spm, n_vocab=n_vocab)
    finally:
        vocab_log.setLevel(level)
    if not spm and not special.merges:
        raise UserError(f"{folder}: tokenizer.json has no BPE merges")
    special.add_to_gguf(writer, quiet=True)
    if special.chat_template is None and tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    return {"model": "llama" if spm else "gpt2", "pre": pre, "tokens": n_vocab, "merges": len(special.merges),
            "special_ids": special.special_token_ids,
            "add_bos": special.add_special_token.get("bos", False),
            "chat_template": bool(special.chat_template or tok.chat_template), **summary}


def _tokens_and_types(by_id: dict, added: dict, n_vocab: int, tokenizer_json: dict, spm: bool):
    """Token strings and llama.cpp token types, one per embedding row."""
    import re

    import gguf

    unk = (tokenizer_json.get("model") or {}).get("unk_token")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in by_id:  # embedding rows past the tokenizer (padded vocab): never produced
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
            if spm and added[i].content == unk:
                types[-1] = gguf.TokenType.UNKNOWN
        else:
            tokens.append(by_id[i])
            byte = spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", by_id[i])  # byte-fallback pieces
            types.append(gguf.TokenType.BYTE if byte else gguf.TokenType.NORMAL)
    return tokens, types
