"""The one exception type for mistakes a user can make.

The CLI turns a `UserError` into one line on stderr and exit code 2; anything else is a bug in
ciuic-doctor and keeps its traceback (GUIDE: "Errors a user can cause ... never a traceback").
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a wrong path, a dead PID, a malformed size, an unknown log format."""

    exit_code = 2


class ProbeFailed(Exception):
    """A probe ran but what it measured is a failure (wrong results, a dead rank, a busbw floor missed).

    The message is the one line to print; the records measured so far are already on disk.
    """

    exit_code = 1
