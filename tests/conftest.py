"""Shared fixtures: the real default model (built once, cached like `make run` caches it)."""

from __future__ import annotations

import os
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
