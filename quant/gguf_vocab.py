"""The tokenizer half of a GGUF file: tokens, types, merges, special ids and the chat template.

llama.cpp re-implements the tokenizer from this metadata, so everything that decides token ids
must be carried over: the byte-level BPE vocabulary and merges (`tokenizer.ggml.model = gpt2`),
which pre-tokenizer regex splits the text first (`tokenizer.ggml.pre`, one of the names llama.cpp
knows), which added tokens are control tokens (parsed from text only when asked), and whether a
BOS is prepended.  A test compares the ids with the Hugging Face tokenizer's on tricky strings.
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
        raise UserError(f"{folder}: only byte-level BPE tokenizers convert to GGUF "
                        f"(tokenizer.json model is {model.get('type')!r})")
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


def add_tokenizer(writer, folder: Path, n_vocab: int) -> dict:
    """Write the tokenizer metadata of checkpoint `folder` into `writer`; return a summary."""
    import gguf
    from transformers import AutoTokenizer

    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise UserError(f"{folder}: no tokenizer.json (a fast byte-level BPE tokenizer is required "
                        "for GGUF)")
    try:
        tokenizer_json = json.loads(tok_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{tok_file}: not valid JSON ({e})") from e
    pre = pre_tokenizer_name(tokenizer_json, folder)

    tok = AutoTokenizer.from_pretrained(str(folder))
    by_id = {i: t for t, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder  # id → AddedToken, for special and user-added tokens
    if len(by_id) > n_vocab:
        raise UserError(f"{folder}: tokenizer has {len(by_id)} tokens but the model's embedding "
                        f"has only {n_vocab} rows")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        if i not in by_id:  # embedding rows past the tokenizer (padded vocab): never produced
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, bos/eos/pad/unk ids, add_bos (parsed from the post-processor) and the chat template.
    # SpecialVocab warns about the pair template ("A <s> B"), which llama.cpp never uses.
    vocab_log = logging.getLogger("gguf.vocab")
    level, vocab_log.level = vocab_log.level, logging.ERROR
    try:
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    finally:
        vocab_log.setLevel(level)
    if not special.merges:
        raise UserError(f"{folder}: tokenizer.json has no BPE merges")
    special.add_to_gguf(writer, quiet=True)
    if special.chat_template is None and tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    return {"model": "gpt2", "pre": pre, "tokens": n_vocab, "merges": len(special.merges),
            "special_ids": special.special_token_ids,
            "add_bos": special.add_special_token.get("bos", False),
            "chat_template": bool(special.chat_template or tok.chat_template)}
