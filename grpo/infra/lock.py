"""One run per output directory: an exclusive lock on `output_dir/.lock`.

`fcntl.flock` is held for the run's life and released by the OS when the process ends,
however it ends (a killed run leaves no stale lock). A second run on a locked directory
fails at once with one line naming the holder's process id. Where flock does not exist
(Windows) the lock is a no-op.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo.errors import UserError

LOCK_FILE = ".lock"


class DirectoryLock:
    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_FILE
        self.file = None

    def acquire(self) -> "DirectoryLock":
        try:
            import fcntl
        except ImportError:  # no flock on this platform
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise UserError(
                f"output_dir '{self.path.parent}' is in use by another run (process {holder}); "
                "wait for it to end or choose another output_dir"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(str(os.getpid()))
        file.flush()
        self.file = file
        return self

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing the descriptor releases the flock
            self.file = None


class NoLock:
    """Processes other than process 0 of a torchrun launch: process 0 holds the lock."""

    def acquire(self) -> "NoLock":
        return self

    def release(self) -> None:
        pass
