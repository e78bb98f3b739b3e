"""A task as a plugin: rows, a verifier, an answer extractor and, optionally, a step verifier:
what `grpo eval`, `grpo compare` and the demo need to measure a model on it (`Task`).

A task is named by a spec, 'pkg.module:name', whose attribute is a `Task` or a function of
no arguments that returns one. Built-in tasks are registered exactly like a user's: `TASKS`
only gives their specs short names ("arithmetic" stands for "grpo.tasks.arithmetic:task").
The user's guide: docs/evaluation.md.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo.errors import UserError
from grpo.infra.imports import builtin_spec, describe, import_object, one_line

if TYPE_CHECKING:
    from grpo.rewards.types import RewardFn

__all__ = ["TASKS", "Task", "load_task"]

# Built-in name -> the spec it stands for.
TASKS: dict[str, str] = {
    "arithmetic": "grpo.tasks.arithmetic:task",
    # Multiplication with a multiply(a, b) tool: the multi-turn task of `grpo demo --tools`.
    "multiply": "grpo.tasks.multiply:task",
    # Checks rows of a reasoning_gym:NAME data path with that task's scorer (the gym extra).
    "reasoning_gym": "grpo.tasks.reasoning_gym:task",
}

_FORM = "pkg.module:name"


@dataclass(frozen=True)
class Task:
    """A verifiable task.

    - `verifier`: a reward function with TRL's signature, as a config's `rewards` names; a
      completion is correct when its score is >= `threshold` (None: cannot score, not correct);
    - `extract_answer`: completion text -> a hashable final answer, None for none (maj@k's votes);
    - `rows(n, *, seed)` (optional): n generated rows with a "prompt" and what the verifier
      reads, the same for the same seed; without it the task verifies the user's rows only;
    - `step_verifier` (optional): a process reward: per completion (end, reward) steps, or
      `{"steps": ..., "expected": K, "missing": 0.0}`, so that the steps a completion leaves
      out are scored as wrong where it stopped (`grpo.rewards.scoring.score_steps` says why).
    """

    name: str  # in messages and reports
    verifier: RewardFn  # TRL signature; correct when score >= threshold
    extract_answer: Callable[[str], Hashable | None]  # the votes of maj@k
    rows: Callable[..., list[dict]] | None = None  # rows(n, *, seed); None: verifies user data only
    step_verifier: RewardFn | None = None  # process supervision: (end, reward) steps per completion
    threshold: float = 0.5

    def __post_init__(self) -> None:
        where = f"task {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise UserError(f"task {self.name!r}: name must be a non-empty string")
        for field in ("verifier", "extract_answer"):
            if not callable(getattr(self, field)):
                raise UserError(f"{where}: {field} must be a function, got a {type(getattr(self, field)).__name__}")
        for field in ("rows", "step_verifier"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise UserError(f"{where}: {field} must be a function or None, got a {type(value).__name__}")
        number = isinstance(self.threshold, numbers.Real) and not isinstance(self.threshold, bool)
        if not (number and math.isfinite(self.threshold)):
            raise UserError(f"{where}: threshold must be a finite number, got {self.threshold!r}")

    def make_rows(self, n: int, *, seed: int) -> list[dict]:
        """`rows(n, seed=seed)`, checked: n dicts, each with a 'prompt'."""
        if self.rows is None:
            raise UserError(f"task {self.name!r} generates no rows (it has no rows function); give data rows")
        try:
            rows = self.rows(n, seed=seed)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"task {self.name!r}: rows({n}, seed={seed}) raised {describe(exc)}") from exc
        if not isinstance(rows, list) or len(rows) != n:
            got = f"{len(rows)} rows" if isinstance(rows, list) else f"a {type(rows).__name__}"
            raise UserError(f"task {self.name!r}: rows({n}, seed={seed}) returned {got}, not a list of {n} rows")
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or "prompt" not in row:
                raise UserError(f"task {self.name!r}: row {i} is {one_line(repr(row), 80)}, not a dict with a 'prompt'")
        return rows


def load_task(spec: str) -> Task:
    """The task a spec names: a built-in name (`TASKS`) or 'pkg.module:name'.

    The attribute is a `Task`, or a function of no arguments that returns one. Every
    mistake (unknown name, module missing or failing to import, no such attribute, not a
    task, a factory that raises) is a one-line UserError that names the spec.
    """
    if not isinstance(spec, str):
        raise UserError(f"task {spec!r}: expected a built-in name or '{_FORM}', got a {type(spec).__name__}")
    target = spec if ":" in spec else builtin_spec(spec, TASKS, kind="task", form=_FORM)
    obj = import_object(target, kind="task", form=_FORM)
    if isinstance(obj, Task):
        return obj
    attr = target.partition(":")[2]
    if isinstance(obj, type) or not callable(obj):
        what = "a class" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise UserError(
            f"task {spec!r}: {attr!r} is not a grpo.tasks.Task or a function that returns one (it is {what})"
        )
    try:
        task = obj()
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"task {spec!r}: calling {attr!r} raised {describe(exc)}") from exc
    if not isinstance(task, Task):
        raise UserError(f"task {spec!r}: {attr}() returned a {type(task).__name__}, not a grpo.tasks.Task")
    return task
