"""Where metrics go: metrics.jsonl always, TensorBoard when asked; behind one interface.

The loop calls `log(step, metrics)` on a `Sinks` and never asks which sinks exist.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol

from grpo.errors import UserError


class Sink(Protocol):
    def log(self, step: int, metrics: dict) -> None: ...
    def close(self) -> None: ...


def _clean(value):
    """JSON has no NaN: a number that is not finite is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlSink:
    """One JSON object per line, flushed at once, so a killed run loses no logged step. A
    line cut short (a full disk, a kill mid-write) is dropped when the run resumes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.file = open(path, "a", encoding="utf-8")

    def log(self, step, metrics):
        try:
            self.file.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
            self.file.flush()
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {err.strerror or err}") from None

    def close(self):
        self.file.close()


class TensorBoardSink:
    def __init__(self, directory: Path, purge_step: int | None = None):
        """`purge_step`: a resumed run's first step; TensorBoard hides the events logged at
        and after it by the run that stopped."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("train.tensorboard needs tensorboard: pip install 'grpo[tensorboard]'") from None
        self.writer = SummaryWriter(str(directory), purge_step=purge_step)

    def log(self, step, metrics):
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class Sinks:
    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _records(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl log, one per line; a line that is not one (cut short by
    a kill or a full disk while it was written) is left out."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return _records(path)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` beside `path` and rename it into place: a reader (or a crash) never sees
    half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def truncate_metrics(path: Path, last_step: int, *, key: str = "step") -> None:
    """Keep the lines whose `key` <= last_step (and only whole lines): a resumed run rewrites
    what came after its checkpoint. Atomic: the log is rewritten beside and renamed."""
    path = Path(path)
    if not path.exists():
        return
    kept = [m for m in _records(path) if m.get(key, 0) <= last_step]
    write_atomic(path, "".join(json.dumps(m) + "\n" for m in kept))
