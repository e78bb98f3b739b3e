"""What reward functions log, as TRL's GRPOTrainer lets them (its reward-function arguments
`log_metric` and `log_extra`):

- `log_metric(name, value)`: a number for the step's line of metrics.jsonl, under `name`
  (several calls in a step, from any function or process: their mean);
- `log_extra(column, values)`: a column of samples.jsonl, one value per completion of the
  batch the function was given (a later call of the same column in a step replaces it).

Each function of a batch gets its own pair (`RewardLog.arguments`), so that a mistake names
it: a name that is not a string, a value that is not a finite number, a column of the wrong
length or that JSON cannot write is one UserError line at the call. An isolated function's
calls are made again in the training process when it returns (`grpo.infra.contain.Recorder`).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from grpo.errors import UserError
from grpo.infra.contain import Recorder
from grpo.infra.imports import one_line

__all__ = ["LOG_ARGUMENTS", "SAMPLE_KEYS", "RewardLog", "merge_metrics"]

_ABSENT = object()  # an argument a logger's call left out
LOG_ARGUMENTS = ("log_metric", "log_extra")  # the reward-function arguments this module gives
# samples.jsonl's own keys (and each reward function's score, "reward/<name>")
SAMPLE_KEYS = ("step", "prompt", "completion", "reward", "advantage", "truncated", "messages")


class RewardLog:
    """One batch's logs: `metrics` (name -> the values logged) and `columns` (column -> one
    value per completion of the batch, N of them)."""

    def __init__(self, n: int):
        self.n = n
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def arguments(self, reward: str) -> dict[str, Recorder]:
        """`log_metric` and `log_extra` for the function named `reward`."""
        return {
            "log_metric": Recorder(partial(self._metric, reward)),
            "log_extra": Recorder(partial(self._extra, reward)),
        }

    def _metric(self, reward: str, name: Any = _ABSENT, value: Any = _ABSENT, *rest) -> None:
        number = _number(value)
        if rest or not isinstance(name, str) or not name or not math.isfinite(number):
            raise UserError(
                f"reward {reward!r} called log_metric({_arguments(name, value, rest)}); "
                "expected log_metric(name, value): a name and a finite number"
            )
        self.metrics.setdefault(name, []).append(number)

    def _extra(self, reward: str, column: Any = _ABSENT, values: Any = _ABSENT, *rest) -> None:
        if isinstance(values, (np.ndarray, torch.Tensor)):
            values = values.tolist()
        listed = not isinstance(values, (str, bytes)) and isinstance(values, Sequence)
        if rest or not isinstance(column, str) or not column or not listed:
            raise UserError(
                f"reward {reward!r} called log_extra({_arguments(column, values, rest)}); "
                "expected log_extra(column, values): a column name and one value per completion"
            )
        if column in SAMPLE_KEYS or column.startswith("reward/"):
            raise UserError(
                f"reward {reward!r} called log_extra({column!r}, ...): samples.jsonl writes {column!r} itself; "
                "choose another column name"
            )
        if len(values) != self.n:
            raise UserError(
                f"reward {reward!r} called log_extra({column!r}, ...) with {len(values)} values "
                f"for {self.n} completions; give one per completion"
            )
        try:
            json.dumps(list(values))
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"reward {reward!r} called log_extra({column!r}, ...) with values samples.jsonl cannot write "
                f"({one_line(str(exc))}); give strings, numbers, lists or dicts"
            ) from None
        self.columns[column] = list(values)

    def select(self, rows: Sequence[int]) -> RewardLog:
        """The log of the completions `rows` (their columns' values); the metrics as they are."""
        log = RewardLog(len(rows))
        log.metrics = self.metrics
        log.columns = {column: [values[i] for i in rows] for column, values in self.columns.items()}
        return log


def _number(value: Any) -> float:
    """A logged metric's value as a float: a real number (numpy's too) or a one-element
    tensor or array (`torch.tensor(rewards).mean()`); NaN for anything else (a bool included)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan


def _arguments(first: Any, second: Any, rest: tuple) -> str:
    """A call's arguments as it was written, on one line and short."""
    shown = [one_line(repr(a))[:60] for a in (first, second, *rest) if a is not _ABSENT]
    return ", ".join(shown)


def merge_metrics(logs: Sequence[dict[str, list[float]]]) -> dict[str, float]:
    """Every process's `RewardLog.metrics` of a step as one: each name's mean over all its
    calls, in the order the names first came."""
    values: dict[str, list[float]] = {}
    for log in logs:
        for name, logged in log.items():
            values.setdefault(name, []).extend(logged)
    return {name: sum(v) / len(v) for name, v in values.items()}
