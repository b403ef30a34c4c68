"""Where the fast engine's compiled kernels live between runs: under `QUANTSERVE_HOME`.

A cold start compiles the decode and prompt graphs (torch.compile / inductor) and tunes the
Triton weight kernels for every shape; both libraries can keep what they built on disk and find
it again on the next start, keyed by the source, the shapes, the GPU and their own versions.
The weight kernels' choice per layer shape (triton_mm.save_choices) is kept there too.
Their defaults sit in /tmp (gone after a reboot, or a fresh container), so the server points
them at a folder of its cache, one per GPU model and library versions.  Settings the user made
($TORCHINDUCTOR_CACHE_DIR, $TRITON_CACHE_DIR) win.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def compile_cache_dir(gpu_name: str) -> Path:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    key = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{gpu_name}-torch{torch.__version__}-triton{triton_version}")
    from quantserve.settings import cache_dir

    return cache_dir() / "compile" / key


def use_compile_cache(gpu_name: str) -> Path | None:
    """Point inductor's and Triton's on-disk caches at our folder (unless set already); the folder,
    or None when it cannot be made (then the libraries' defaults stay, and starts are cold)."""
    folder = compile_cache_dir(gpu_name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))
    return folder
