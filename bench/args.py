"""Command-line parsing shared by the bench scripts: a bad value is one line and exit 2, found
before any work starts (not after a model was built or a server was loaded for minutes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
    return value


def positive_int(text: str) -> int:
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    return _whole(text, 0)


def int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; '' -> []."""
    return [positive_int(x.strip()) for x in text.split(",") if x.strip()]


def choice_list(*choices: str):
    """A parser for a comma list whose items must be among `choices`."""
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"'{','.join(bad) or text}': choose from {', '.join(choices)}")
        return items
    return parse


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text
