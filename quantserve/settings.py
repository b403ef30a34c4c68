"""Settings shared by every part: where things are cached, and the errors users see as one line."""

from __future__ import annotations

import os
from pathlib import Path


class UserError(Exception):
    """A problem with what the user asked for. The CLIs print it as one line and exit non-zero."""


def cache_dir() -> Path:
    """`$QUANTSERVE_HOME`, else `$XDG_CACHE_HOME/quantserve`, else `~/.cache/quantserve`."""
    if os.environ.get("QUANTSERVE_HOME"):
        return Path(os.environ["QUANTSERVE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantserve"


def require_checkpoint(path: Path) -> Path:
    """Check that `path` is a Hugging Face checkpoint folder (config.json + weights), or raise.

    A LoRA adapter folder (adapter_config.json) also counts: callers merge it into its base.
    """
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if not path.is_dir():
        raise UserError(f"{path}: not a checkpoint folder (expected a folder with config.json)")
    if (path / "adapter_config.json").is_file():
        return path
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: not a Hugging Face checkpoint (no config.json)")
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    if not has_weights:
        raise UserError(f"{path}: checkpoint has config.json but no weight files (*.safetensors)")
    return path
