"""The project's error types: what the command-line tools report as the user's mistake.

``UserError`` is raised where the input is wrong (a config field, an override, a run
directory, a damaged or missing file the user named) and the message already says what
was expected. The command-line tools (``mta_repro.cli.run_cli``) print such an error as
one line and exit with status 2; any other exception is a fault in the code or its
environment and keeps its traceback. ``MTA_REPRO_TRACEBACK=1`` shows the traceback of
user errors too.

``UserError`` subclasses ``ValueError`` so that code (and tests) catching ValueError
around validation keeps working.
"""

from __future__ import annotations

import os

# Set to 1 to see full tracebacks for user errors as well.
TRACEBACK_ENV = "MTA_REPRO_TRACEBACK"


class UserError(ValueError):
    """Bad input: the message names the file/field, what was expected and the fix."""


def show_tracebacks() -> bool:
    """Whether ``MTA_REPRO_TRACEBACK`` asks for tracebacks of user errors too."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")


class CorruptFileError(UserError):
    """A file that cannot be read to its end or is damaged (a truncated download, a torn
    write, a weights file that is not one): the message names it."""


class UnsafeFileError(UserError):
    """A file whose unpickling would build objects other than tensors and plain types (and
    could run code): refused, never loaded. The message names the file and the object."""


class NoSpaceError(UserError):
    """The disk filled up: the message names the path, the bytes needed and those free.
    Not the input's fault, but the user's to fix (free space, then rerun to resume), so it
    is reported as one line like a user error."""


class PeerFailedError(UserError):
    """Another rank of the job failed (its own error says why, on its own stderr): this rank
    stops too, in one line naming that rank, and leaves the run's files as they are. Never a
    reason to call a checkpoint damaged."""


class StopRequested(BaseException):
    """A stop signal (Ctrl-C, SIGTERM, SIGUSR2) seen by work that loops (data loading,
    the loader's warm-up, validation) at its next check, where nothing is left to save.
    The command-line tools print its message as one line and exit with 128 + the signal's
    number, as a stop after a checkpoint does. A BaseException, like KeyboardInterrupt, so
    that no ``except Exception`` on its way swallows it."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = int(signum)
