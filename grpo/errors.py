"""The one exception type for mistakes in what the user gave us (config, data, paths).

The command line prints its message as one line and exits non-zero, without a traceback;
anything else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: the message says what and where, in one line."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type when it has none), for UserErrors
    that wrap a library's multi-line error."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class Lost(UserError):
    """An environment that cannot go on (its server gone): raised by one of its tools, it stops
    the run in one line (the loop saves the last completed step) instead of answering the call."""


class Stopped(Exception):
    """A run that stopped on a signal (Ctrl-C, SIGTERM) after saving what it had: the message
    says what was saved and how to resume; `code` is the exit status (128 + the signal)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
