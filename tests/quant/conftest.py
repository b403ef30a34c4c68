"""Fixtures the quant tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def small_heldout(tmp_path_factory):
    """24 held-out chats (~700 tokens): stable enough, and fast on bnb's slow CPU int8 kernels."""
    from quantserve.demo import corpus

    path = tmp_path_factory.mktemp("text") / "heldout.jsonl"
    corpus.write_jsonl(path, corpus.examples(corpus.PRETRAIN_SKILLS + [corpus.TASK_SKILL], 24, 2000, "heldout"))
    return path
