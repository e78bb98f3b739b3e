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
    """One JSON object per line, flushed at once, so a killed run loses no logged step."""

    def __init__(self, path: Path):
        self.file = open(path, "a", encoding="utf-8")

    def log(self, step, metrics):
        self.file.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


class TensorBoardSink:
    def __init__(self, directory: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("train.tensorboard needs tensorboard: pip install 'grpo[tensorboard]'") from None
        self.writer = SummaryWriter(str(directory))

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


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, last_step: int, *, key: str = "step") -> None:
    """Keep the lines whose `key` <= last_step: a resumed run rewrites what came after its checkpoint."""
    if not Path(path).exists():
        return
    kept = [m for m in read_metrics(path) if m.get(key, 0) <= last_step]
    Path(path).write_text("".join(json.dumps(m) + "\n" for m in kept))
