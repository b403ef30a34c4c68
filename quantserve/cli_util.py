"""Running a typer app so that every failure is one clear line and a non-zero exit.

Typer/click print a usage box and rich tracebacks by default; users of a CLI want one line that
names the problem.  `QUANTSERVE_DEBUG=1` brings the full traceback back for bug reports.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from quantserve.settings import UsageError, UserError

try:  # typer >= 0.29 carries its own copy of click, and raises that copy's exceptions
    from typer._click import exceptions as click_exceptions
except ImportError:  # older typer: plain click
    from click import exceptions as click_exceptions


class Interrupted(click_exceptions.ClickException):
    """Ctrl-C (or a SIGTERM a command turns into one) while a command ran: one line, exit 130."""

    exit_code = 130


def reports_interrupts(command):
    """Mark a command that prints its own "interrupted: ..." line on Ctrl-C (`train`: where a rerun
    resumes): `run` adds none to it."""
    command.reports_interrupts = True
    return command


class _Group(TyperGroup):
    """Typer turns a KeyboardInterrupt into a silent `Exit(130)` before `_run` can see it, so a
    Ctrl-C printed nothing.  Here, below typer, it becomes `Interrupted`: "interrupted", plus the
    resume hint a command may give as the KeyboardInterrupt's text."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            if os.environ.get("QUANTSERVE_DEBUG"):  # where it was when stopped (a hang's report)
                import traceback

                traceback.print_exc()
            command = self.get_command(ctx, ctx.invoked_subcommand) if ctx.invoked_subcommand else None
            if getattr(getattr(command, "callback", None), "reports_interrupts", False):
                raise typer.Exit(130) from None  # its own line said it; an Exit passes the groups above
            raise Interrupted(f"interrupted: {e}" if str(e) else "interrupted") from None


def new_app(help: str) -> typer.Typer:
    app = typer.Typer(help=help, no_args_is_help=True, add_completion=False, cls=_Group,
                      pretty_exceptions_enable=False, rich_markup_mode=None)

    @app.callback()
    def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                              help="Print the version and exit.")) -> None:
        pass

    return app


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"quantserve {version('quantserve')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("quantserve (not installed)")
        raise typer.Exit()


def fail(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run(app: typer.Typer, prog: str) -> None:
    """Entry point wrapper: usage errors exit 2, user errors 1, interrupts 130."""
    try:
        _run(app, prog)
    except BrokenPipeError:  # `quantserve ... | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None


def _run(app: typer.Typer, prog: str) -> None:
    try:
        code = app(prog_name=prog, standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as e:
        # nothing was asked for: the help, as `--help` prints it (click leaves that to its
        # standalone mode, which this wrapper turns off)
        print(e.ctx.get_help() if e.ctx else e.format_message())
        raise SystemExit(0) from e
    except click_exceptions.UsageError as e:
        where = f" (see '{prog} {e.ctx.command_path.split(' ', 1)[1]} --help')" if e.ctx and " " in e.ctx.command_path else f" (see '{prog} --help')"
        fail(f"{e.format_message()}{where}", 2)
    except typer.Abort:
        fail("aborted", 130)
    except KeyboardInterrupt:  # outside a command (while parsing); a command's: _Group.invoke
        fail("interrupted", 130)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except click_exceptions.ClickException as e:
        fail(e.format_message(), e.exit_code or 1)
    except UsageError as e:
        fail(str(e), 2)
    except UserError as e:
        fail(str(e), 1)
    except (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
        if os.environ.get("QUANTSERVE_DEBUG"):
            raise
        fail(f"{e.strerror or e}: {e.filename}" if getattr(e, "filename", None) else str(e), 1)
    except Exception as e:  # last resort: never a traceback for users unless they ask
        if os.environ.get("QUANTSERVE_DEBUG"):
            raise
        # every line, joined (up to 300 characters): some libraries' first line only announces the reason
        # ("Class validation error for validator ...:"), which the second gives
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300]
        fail(f"{type(e).__name__}: {reason} (set QUANTSERVE_DEBUG=1 for the traceback)", 1)
    # without standalone mode click returns a command's `typer.Exit(code)` instead of exiting with it
    if isinstance(code, int) and code:
        raise SystemExit(code)
