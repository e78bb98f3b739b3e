"""Learning-rate schedules: linear warm-up, then constant, linear decay or cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable


def _constant(progress: float) -> float:
    return 1.0


def _linear(progress: float) -> float:
    return max(0.0, 1.0 - progress)


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the base learning rate after `update` optimizer steps (for LambdaLR)."""
    decay = SCHEDULES[kind]

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        return decay((update - warmup) / max(1, total - warmup))

    return factor
