"""Progress a person reads: a bar on a terminal, plain lines in a file or a cluster's log.

A tqdm bar redraws one line with carriage returns; redirected to a file (`2> log`, a batch
system's log) it becomes one ever-growing line that `tail -f` cannot follow. So every long
command reports through `Progress`, which looks once at where stderr goes: a terminal (or a
notebook) gets the bar, anything else one flushed line per `every` units (the first and
the last always), and `enabled=False` (--quiet, or not process 0) nothing. A line's rate is
over the units since the previous line (the current speed), its elapsed time since the start.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_elapsed", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether a bar can redraw itself on `stream`: a terminal, or a Jupyter cell's output
    (where tqdm.auto draws a widget, and isatty() is False)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty is not None and isatty():
            return True
    except ValueError:  # a closed stream
        return False
    return type(stream).__module__.startswith("ipykernel")


def format_elapsed(seconds: float) -> str:
    """'M:SS' under an hour, 'H:MM:SS' from then on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _format(value) -> str:
    """A field's value as shown: floats with 4 decimals, None and NaN as '-', the rest as str
    (a caller that wants another format passes a string)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


class Progress:
    """The progress of `total` units of work (steps, completions, ...), as the module says:

        with Progress(steps, desc="sft", prefix="grpo sft", every=log_every, enabled=progress) as progress:
            for step in range(steps):
                ...
                progress.update(1, loss=loss.item())

    `desc` labels the bar, `prefix` starts each plain line ("grpo eval: ..."), `unit` names
    what is counted (the line says "{unit} {done}/{total}") and the rate: seconds per unit,
    or units per second with `per_second` (for many small units). `every`: a line each time
    the count passes a multiple of it. `initial`: units done before (a resumed run). `stream`:
    where it goes (default: sys.stderr as it is now, so that a test's capture sees it).
    """

    def __init__(
        self,
        total: int,
        *,
        desc: str,
        prefix: str = "grpo",
        unit: str = "step",
        every: int = 10,
        enabled: bool = True,
        initial: int = 0,
        per_second: bool = False,
        stream: TextIO | None = None,
    ):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.total, self.prefix, self.unit, self.every, self.per_second = total, prefix, unit, every, per_second
        self.count = initial
        self.stream = sys.stderr if stream is None else stream
        self.started = self.last_time = time.monotonic()
        self.last_count = initial
        self.logged = False  # no line yet: the first update prints one
        self.bar = None
        self.lines = False
        if enabled and is_terminal(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=self.stream)
        else:
            self.lines = enabled

    def update(self, n: int = 1, **fields) -> None:
        """`n` more units done; `fields` (name=value) are the latest numbers to show."""
        previous, self.count = self.count, self.count + n
        if self.bar is not None:
            if fields:
                self.bar.set_postfix({k: _format(v) for k, v in fields.items()}, refresh=False)
            self.bar.update(n)
            return
        passed = self.count // self.every > previous // self.every
        if self.lines and (not self.logged or passed or self.count >= self.total):
            self.stream.write(self.line(fields) + "\n")
            self.stream.flush()
            self.logged = True

    def line(self, fields: dict) -> str:
        """The plain line for the current count and `fields`; restarts the rate's interval."""
        now = time.monotonic()
        done, seconds = self.count - self.last_count, now - self.last_time
        self.last_count, self.last_time = self.count, now
        if self.per_second:
            rate = f"{done / seconds:.1f} {self.unit}/s" if seconds > 0 else f"- {self.unit}/s"
        else:
            rate = f"{seconds / done:.2f} s/{self.unit}" if done > 0 else f"- s/{self.unit}"
        parts = [f"{self.prefix}: {self.unit} {self.count}/{self.total}"]
        parts += [f"{name} {_format(value)}" for name, value in fields.items()]
        parts += [f"elapsed {format_elapsed(now - self.started)}", rate]
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
