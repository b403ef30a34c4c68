"""Shared fixtures: the real default model (built once, cached like `make run` caches it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests never reach a model hub: everything they load is built here.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval loads its local task files through datasets
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_model() -> Path:
    """Folder of the embedded default checkpoint (the shipped build)."""
    from quantserve.demo.default_model import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(autouse=True)
def grad_mode_left_as_found():
    """A test that turns autograd off process-wide breaks every training test after it in the same
    process, and which ones those are depends on the order the tests run in: fail the test itself."""
    torch = sys.modules.get("torch")
    before = torch.is_grad_enabled() if torch else True
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.is_grad_enabled() != before:
        torch.set_grad_enabled(before)
        pytest.fail("the test left autograd's grad mode changed: set it in a `with` block")
