"""The embedded demo: the default corpus, its tokenizer and the tiny default model built on it.

Only the CLI layer (`quantserve.cli`, `quantserve.pipeline`), the benchmarks and the tests import
this package; importing it registers the name "default" (the model, and the held-out text that
`quant eval` scores) with `quantserve.settings`, so the server, quant and training layers take
"default" without importing it.
"""

from __future__ import annotations

from quantserve.settings import register_eval_text, register_model_name


def _default_model(progress: bool):
    from quantserve.demo.default_model import default_model_path

    return default_model_path(progress=progress)


def _heldout_documents(tokenizer) -> tuple[list[str], str]:
    from quantserve.demo import corpus
    from quantserve.demo.tokenizer import render_chat

    exs = corpus.examples(corpus.PRETRAIN_SKILLS + [corpus.TASK_SKILL], 400, 2000, "heldout")
    return [render_chat(tokenizer, e.messages()) for e in exs], "default corpus held-out split (400 chats)"


register_model_name("default", _default_model)
register_eval_text("default", _heldout_documents)
