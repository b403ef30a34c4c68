"""Command-line parsing shared by the bench scripts: a bad value is one line and exit 2, found
before any work starts (not after a model was built or a server was loaded for minutes).

`Parser` serves the argparse scripts (`python -m quantserve.bench.default_model_sweep` and the
like); the value parsers below serve `quantserve bench`'s typer options, whose comma lists
('1,8,32') arrive as text.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import typer


class _ShowDefaults(argparse.HelpFormatter):
    """Each option's default after its help, unless the help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) and each option's default in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


# typer reports a BadParameter as "Invalid value for '--option': <message>" and exits 2


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"'{text}' is not a whole number") from None
    if value < 1:
        raise typer.BadParameter(f"{value} must be at least 1")
    return value


def int_list(allow_empty: bool = False):
    """A parser for a comma list of whole numbers of at least 1: '1,8,32' -> (1, 8, 32)."""
    def parse(text: str) -> tuple[int, ...]:
        values = tuple(_positive(x) for x in _items(text))
        if not values and not allow_empty:
            raise typer.BadParameter("give at least one number")
        return values
    return parse


def choice_list(*choices: str):
    """A parser for a comma list whose items must be among `choices`: 'none,int8' -> ('none', 'int8')."""
    def parse(text: str) -> tuple[str, ...]:
        items = _items(text)
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise typer.BadParameter(f"'{','.join(bad) or text}': choose from {', '.join(choices)}")
        return tuple(items)
    return parse


def choice(*choices: str):
    """A parser for one of `choices`."""
    def parse(text: str) -> str:
        if text not in choices:
            raise typer.BadParameter(f"'{text}': choose from {', '.join(choices)}")
        return text
    return parse


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise typer.BadParameter(f"{text}: no such file")
    return text


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0 (NaN slips past typer's min=, and 0 would mean "none")."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"'{text}' is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{text}: a number of seconds above 0")
    return value


def require_writable_output(out: str | Path) -> None:
    """Where a bench writes its JSON, checked before any work: a run's figures must not be lost to a
    bad path at its end (the folder is made; a folder named as the file is refused)."""
    from quantserve.settings import UserError, require_creatable_folder

    require_creatable_folder(Path(out).parent)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if Path(out).is_dir():
        raise UserError(f"--out {out} is a folder: name a JSON file")


def quick_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser, **sizes) -> None:
    """A script's --quick: its small `sizes` set where the command line gave none of its own (a given
    one is kept, never silently replaced)."""
    for name, value in sizes.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
