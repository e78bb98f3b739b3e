"""Ctrl-C and SIGTERM during training: stop after the step in progress, which then saves a
checkpoint; a second one stops at once."""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["Signals"]


class Signals:
    """Ctrl-C and SIGTERM ask the run to stop after the step in progress (which then saves a
    checkpoint); a second one stops at once (KeyboardInterrupt). The handlers are set on
    entry (on the main thread only: Python allows no other) and put back on exit."""

    NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.NAMES:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        print(
            f"\ngrpo: {self.NAMES[signum]}: stopping after this step and saving a checkpoint (again to stop at once)",
            file=sys.stderr,
        )

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    @classmethod
    def name(cls, signum: int) -> str:
        return cls.NAMES.get(signum, f"signal {signum}")
