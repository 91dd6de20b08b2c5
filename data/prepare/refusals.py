"""The refusals of ``data.prepare``: each an ``errors.ProjectError`` carrying its exit code, and
the one ``error:`` line that reports it.

Every other module of the package raises these; cli.py catches them and prints the line. They sit
in a module of their own, importing nothing of the package, so that any module may raise them.
"""

from __future__ import annotations

import sys

from errors import ConfigError, ExitCode, ProjectError

# Those raised once tokenizing began say that no output was written.
NOTHING_WRITTEN = "; no output written"


class StrictError(ProjectError):
    """--strict: a record that cannot be read (exit 7)."""

    code = ExitCode.BAD_INPUT


class InputError(ProjectError):
    """An input that cannot be read to its end (a truncated or corrupt .gz): exit 7."""

    code = ExitCode.BAD_INPUT


class OutputError(ProjectError):
    """The output cannot be written (read-only, not a directory, no permission, disk full): exit 8."""

    code = ExitCode.UNWRITABLE


def cannot_write(output: str, exc: OSError) -> OutputError:
    where = f": {exc.filename}" if exc.filename else ""
    return OutputError(f"--output {output} cannot be written: {exc.strerror or exc}{where}"
                       f"{NOTHING_WRITTEN}")


class UsageError(ConfigError):
    """Bad arguments or inputs, found before anything is written (exit 2)."""


def print_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)  # unwrapped: file:line stays greppable
