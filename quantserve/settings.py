"""Settings shared by every part: where things are cached, and the errors users see as one line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


class UserError(Exception):
    """A problem with what the user asked for. The CLIs print it as one line and exit 1."""


class UsageError(UserError):
    """An option's value is not one it can take (an unknown choice, a number out of range): exit 2,
    like a malformed command line."""


def cache_dir() -> Path:
    """`$QUANTSERVE_HOME`, else `$XDG_CACHE_HOME/quantserve`, else `~/.cache/quantserve`."""
    if os.environ.get("QUANTSERVE_HOME"):
        return Path(os.environ["QUANTSERVE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quantserve"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick), for a child server or a process group's rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_readable(folder: Path) -> None:
    """Give every file in `folder` the mode the umask allows (0644 by default).

    safetensors writes its files 0600: a model trained or converted as one user (root in a build
    step, say) would be unreadable by the server's user (the container's uid 1000)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [Path(folder), *Path(folder).rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def require_creatable_folder(folder: Path, flag: str = "--out") -> Path:
    """Fail now, not after a model has loaded, when `folder` cannot be made or written into: one
    line naming `flag` and where it was refused.  Nothing is left behind: a folder is made and
    removed in the nearest existing one, since permission bits do not tell (root passes them;
    /proc, read-only mounts and full disks refuse anyway)."""
    import tempfile

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder}: exists and is not a folder")
    parent = folder.absolute()
    try:
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise UserError(f"{flag} {folder}: {parent} is a file, not a folder")
        os.rmdir(tempfile.mkdtemp(prefix=".quantserve-write-check-", dir=parent))
    except OSError as e:
        raise UserError(f"{flag} {folder}: cannot create a folder in {parent} ({e.strerror or e})") from None
    return folder


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


# Names a user may type instead of a path ("default": the embedded model).  The layers below the
# CLI (server, quant, training) resolve `--model` here and never import what a name stands for;
# the CLI layer registers the names it offers (quantserve.demo registers "default").
_MODEL_NAMES: dict[str, Callable[[bool], Path]] = {}
# The same for the text `quant eval` scores when it is given none: name -> f(tokenizer) -> documents
_EVAL_TEXTS: dict[str, Callable[[object], tuple[list[str], str]]] = {}


def register_model_name(name: str, resolve: Callable[[bool], Path]) -> None:
    _MODEL_NAMES[name] = resolve


def register_eval_text(name: str, documents: Callable[[object], tuple[list[str], str]]) -> None:
    _EVAL_TEXTS[name] = documents


def resolve_checkpoint(model: str | Path | None, progress: bool = True) -> Path:
    """A `--model` argument as a checkpoint folder: a registered name (None = "default") or a path."""
    name = "default" if model is None else str(model)
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name](progress)
    if model is None or name == "default":
        raise UserError("no model given, and no default model is registered in this process "
                        "(the quantserve CLI registers the embedded one: import quantserve.demo)")
    return require_checkpoint(Path(model))


def default_eval_text(tokenizer) -> tuple[list[str], str]:
    """The documents `quant eval` scores when given no text file, and a label for them."""
    if "default" not in _EVAL_TEXTS:
        raise UserError("no text to score: pass --text FILE")
    return _EVAL_TEXTS["default"](tokenizer)
