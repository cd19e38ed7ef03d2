"""User-facing errors.

An :class:`MpiflError` is a problem with the user's input or environment (a
missing shard, an unknown algorithm, too few ranks, a NaN loss).  Its message
is one line that names the problem and the fix; the runtime prints it without
a traceback and ends the whole MPI job.  Any other exception is a bug and is
reported with its traceback written to the run directory.  A command that click runs shows it as
:class:`OneLine`.
"""

import click


class MpiflError(Exception):
    """A one-line, actionable error shown to the user without a traceback."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class OneLine(click.ClickException):
    """A refusal as click shows it for mpifl: ``mpifl: error: <message>``, one line on stderr, and the exit code
    (an :class:`MpiflError`'s, 2, by default)."""

    def __init__(self, message: str, exit_code: int = MpiflError.exit_code):
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"mpifl: error: {self.message}", err=True)
