"""`quant eval SRC QUANTIZED`: what quantization cost, measured on held-out text.

Both models score the same token windows (tokenized once, by the source's Hugging Face tokenizer,
so the comparison is of weights and kernels, not of tokenizers):

* perplexity of each, and the difference;
* top-1 agreement: how often the quantized model's most likely next token is the source's;
* relative logit error ‖L_q − L_s‖ / ‖L_s‖ over every position, and the mean KL(p_s ‖ p_q).

The source runs in fp32 through transformers (on the GPU when it fits); a GGUF output runs through
llama.cpp itself (in a worker process), a bitsandbytes output through transformers + bitsandbytes —
each in the engine that will serve it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from quantserve.formats import NotAModel, identify
from quantserve.quant.manifest import check_weights, write_manifest
from quantserve.quant.source import checkpoint_tokenizer, open_checkpoint
from quantserve.settings import UserError

WINDOW = 256  # tokens per scored window; each window starts from an empty context


_PIPES: dict[Path, str] = {}  # a pipe (`--text <(cmd)`) can be read once: its text, for the second read


def read_text_file(path: Path) -> str:
    """The contents of a `--text` file, or a UserError saying why it cannot be read; `quant eval`
    and `quant table` call it first, before any model is loaded or converted.  A .jsonl file's
    records are checked here too, naming the line."""
    path = Path(path)
    if path in _PIPES:
        return _PIPES[path]
    if path.is_dir():
        raise UserError(f"{path}: is a folder, not a text file")
    if not path.exists():
        raise UserError(f"{path}: no such text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text") from e
    if not path.is_file():
        _PIPES[path] = text
    if path.suffix == ".jsonl":
        chat_records(path, text)
    return text


def chat_records(path: Path, raw: str) -> list[list[dict]]:
    """The conversations of a .jsonl `--text`, each a non-empty list of messages with a role and
    string content (the chat template's own error names neither the file nor the line)."""
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: not a {{\"messages\": [...]}} record") from e
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise UserError(f"{path}:{n}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} "
                            "messages with string values")
        out.append(msgs)
    return out


def heldout_documents(text_file: Path | None, tokenizer) -> tuple[list[str], str]:
    """Documents to score and a label for where they came from.

    No file: the default corpus's held-out split, rendered with the chat template (what
    `quantserve data` writes as heldout.jsonl).  A .jsonl of {"messages": [...]} records is
    rendered the same way; any other file is plain text, one document per blank-line block.
    """
    from quantserve.settings import default_eval_text

    if text_file is None:
        return default_eval_text(tokenizer)
    path = Path(text_file)
    raw = read_text_file(path)
    if path.suffix == ".jsonl":
        docs = [tokenizer.apply_chat_template(msgs, tokenize=False) for msgs in chat_records(path, raw)]
    else:
        docs = [block for block in raw.split("\n\n") if block.strip()]
    if not docs:
        raise UserError(f"{path}: no text to score")
    return docs, str(path)


def token_windows(tokenizer, docs: list[str], window: int = WINDOW) -> list[list[int]]:
    """Concatenate the documents' tokens and cut them into windows (a short last one kept)."""
    stream: list[int] = []
    for doc in docs:
        # chat renderings carry their BOS already; plain text gets one from the tokenizer
        stream += tokenizer(doc, add_special_tokens=not doc.startswith(tokenizer.bos_token or "\0")).input_ids
    windows = [stream[i:i + window] for i in range(0, len(stream), window)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise UserError("the text is too short to score (fewer than 2 tokens)")
    return windows


def transformers_logits(model, windows: list[list[int]]):
    import numpy as np
    import torch

    out = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w], device=model.device)
            out.append(model(input_ids=ids).logits[0].float().cpu().numpy().astype(np.float32))
    return out


def gguf_logits(path: Path, windows: list[list[int]]):
    """llama.cpp's logits for each window, computed in a worker process (quant/llamacpp_worker.py)."""
    from quantserve.quant.llamacpp_worker import LogitsWorker

    with LogitsWorker(path, n_ctx=max(len(w) for w in windows)) as worker:
        return [worker.logits(w) for w in windows]


def compare(src: list, quant: list, windows: list[list[int]]) -> dict:
    """Perplexities, agreement, relative logit error and KL over all predicted positions."""
    import numpy as np

    def log_softmax(x):
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    nll_s = nll_q = kl = 0.0
    agree = n = 0
    diff_sq = ref_sq = 0.0
    for ls, lq, w in zip(src, quant, windows):
        ls, lq = ls[: len(w) - 1].astype(np.float64), lq[: len(w) - 1].astype(np.float64)
        target = np.asarray(w[1:])
        lps, lpq = log_softmax(ls), log_softmax(lq)
        rows = np.arange(len(target))
        nll_s -= lps[rows, target].sum()
        nll_q -= lpq[rows, target].sum()
        kl += (np.exp(lps) * (lps - lpq)).sum()
        agree += int((ls.argmax(-1) == lq.argmax(-1)).sum())
        diff_sq += float(((lq - ls) ** 2).sum())
        ref_sq += float((ls ** 2).sum())
        n += len(target)
    ppl_s, ppl_q = float(np.exp(nll_s / n)), float(np.exp(nll_q / n))
    return {"tokens": n, "ppl_source": round(ppl_s, 4), "ppl": round(ppl_q, 4),
            "delta_ppl": round(ppl_q - ppl_s, 4), "delta_pct": round(100 * (ppl_q / ppl_s - 1), 3),
            "top1_agreement": round(agree / n, 4),
            "rel_logit_error": float(f"{np.sqrt(diff_sq / ref_sq):.3g}"),
            "kl_divergence": float(f"{kl / n:.3g}")}


def _quantized_kind(quantized: Path) -> tuple[str, Path, dict | None]:
    """('gguf', file, manifest) or ('transformers', folder, manifest) for what was given."""
    try:
        found = identify(quantized)
    except NotAModel as e:
        raise UserError(str(e)) from None
    return ("gguf" if found.container == "gguf" else "transformers"), found.path, found.manifest


# The source's logits for the last text scored: `quant table` scores many outputs of one source.
_SOURCE_CACHE: dict[tuple, tuple] = {}


def _source_logits(src: Path, text_file: Path | None):
    """(windows, logits, label, weight bytes) of the fp32 source on the held-out text."""
    from quantserve.modeling import load_model, reference_run

    with tempfile.TemporaryDirectory(prefix="quant-eval-") as tmp:
        ckpt = open_checkpoint(Path(src), merge_dir=Path(tmp) / "merged")
        text_key = (str(text_file), Path(text_file).stat().st_mtime_ns) if text_file and Path(text_file).is_file() else None
        key = (tuple(sorted(ckpt.source_files.items())), text_key)
        if key not in _SOURCE_CACHE:
            tokenizer = checkpoint_tokenizer(ckpt.path)
            docs, label = heldout_documents(text_file, tokenizer)
            windows = token_windows(tokenizer, docs)
            with reference_run(load_model(ckpt.path)) as model:
                logits = transformers_logits(model, windows)
            _SOURCE_CACHE.clear()
            _SOURCE_CACHE[key] = (windows, logits, label, sum(f.stat().st_size for f in ckpt.weight_files),
                                  ckpt.source_files)
        return _SOURCE_CACHE[key]


def _model_files(hashes: dict[str, str]) -> dict[str, str]:
    """The hashes that say which model a folder is: its weights and configs (a README edited or a
    generation_config added since does not make it another model)."""
    return {name: h for name, h in hashes.items() if name.endswith((".safetensors", "config.json"))
            and name != "generation_config.json"}


def evaluate(src: Path, quantized: Path, text_file: Path | None = None) -> dict:
    """Score `quantized` against its source; store the row in the quantized folder's manifest."""
    from quantserve.progress import transformers_bars

    if text_file is not None:  # a bad --text is found before either model loads
        read_text_file(text_file)
    kind, target, manifest = _quantized_kind(Path(quantized))
    if kind == "transformers":  # before the source runs: a broken output is found in a second, by name
        check_weights(target, manifest)
    with transformers_bars(False):  # weight-loading bars: noise around a one-line result
        windows, src_logits, text_label, source_bytes, source_files = _source_logits(Path(src), text_file)
        converted_from = ((manifest or {}).get("source") or {}).get("files_sha256")
        if converted_from and _model_files(converted_from) != _model_files(source_files):
            raise UserError(f"{quantized} was converted from another checkpoint than {src} (its manifest's source "
                            "hashes differ): convert it again from this one (quant table: --force)")
        if kind == "gguf":
            q_logits = gguf_logits(target, windows)
            size = target.stat().st_size
        else:
            from quantserve.quant.bnb import load_bnb

            q_logits = transformers_logits(load_bnb(target), windows)
            size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    if q_logits[0].shape[-1] < src_logits[0].shape[-1]:
        raise UserError(f"{quantized}: vocabulary ({q_logits[0].shape[-1]}) is smaller than the "
                        f"source's ({src_logits[0].shape[-1]}): not a conversion of {src}")
    q_logits = [q[:, : s.shape[-1]] for q, s in zip(q_logits, src_logits)]
    row = {"format": manifest["format"] if manifest else kind, "engine":
           "llama.cpp" if kind == "gguf" else "transformers",
           "size_mib": round(size / 2**20, 3), "source_size_mib": round(source_bytes / 2**20, 3),
           **compare(src_logits, q_logits, windows), "text": text_label}
    if manifest is not None:
        manifest["quality"] = row
        write_manifest(Path(quantized), manifest)
    return row
