"""Writes that fail for lack of space: a full disk (ENOSPC), a full quota (EDQUOT) and a
file-size limit (EFBIG, `ulimit -f`) are one failure to the user, and need one remedy.

Libraries report them in their own ways: Python as an OSError, torch.save as a RuntimeError
raised while the OSError of its file's write was being handled, safetensors as an error
whose text ends '(os error 28)', torch.distributed.checkpoint as a CheckpointException that
holds each process's error. `no_space` finds the one underneath; `writing(path)` turns any
of them into a `NoSpace` that names the file, so that a run can say in one line what could
not be written, and where.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["NO_SPACE", "NoSpace", "no_space", "writing"]

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends its text (safetensors)


class NoSpace(OSError):
    """A write of `filename` that failed for lack of space; its text is one line."""

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


def _underneath(err: BaseException) -> Iterator[BaseException]:
    """`err`, what it was raised from or while handling, and the errors a
    torch.distributed.checkpoint CheckpointException gathered from each process."""
    seen, pending = set(), [err]
    while pending:
        exc = pending.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        pending += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def no_space(err: BaseException) -> OSError | None:
    """The error underneath `err` that says a write failed for lack of space (the first
    NoSpace, else the first such OSError), or None."""
    found = None
    for exc in _underneath(err):
        if isinstance(exc, NoSpace):
            return exc
        if found is None and isinstance(exc, OSError) and exc.errno in NO_SPACE:
            found = exc
        elif found is None and (match := _OS_ERROR.search(str(exc))) and int(match.group(1)) in NO_SPACE:
            code = int(match.group(1))
            found = OSError(code, os.strerror(code))
    return found


@contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Around a write of `path`: a failure for lack of space, however the library reports
    it, is raised as NoSpace naming `path` (from the original); any other error as it is."""
    try:
        yield
    except NoSpace:
        raise
    except BaseException as err:
        found = no_space(err)
        if found is None:
            raise
        raise NoSpace(found.errno, found.strerror or os.strerror(found.errno), str(path)) from err
