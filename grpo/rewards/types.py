"""The reward-function protocol and the types around it: what a resolved reward is, and what
scoring a batch returns.

Both `grpo.rewards.scoring` (which builds and calls them) and `grpo.infra.contain` (which
runs one call of them) need these; they live here so that neither imports the other back.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo.errors import UserError
from grpo.infra.imports import one_line

__all__ = ["SPEC_FORM", "RewardFn", "RewardScores", "StepScores", "WeightedReward"]

SPEC_FORM = "pkg.module:function"  # a user's reward spec, in messages


class RewardFn(Protocol):
    """fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) ->
    one score per completion; None = cannot score.

    `columns` are the dataset's other columns, each a list row-aligned with `completions`
    (TRL's GRPOTrainer convention, so its reward functions work unchanged).
    """

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]: ...


@dataclass(frozen=True)
class WeightedReward:
    """A resolved reward function, its weight in the total, and how its calls are contained
    (`grpo.infra.contain`)."""

    name: str  # the spec as written (built-in name or 'pkg.module:attr'), '#2' on repeats
    fn: RewardFn
    weight: float
    timeout: float | None = None  # seconds one call may take; None = no limit
    on_timeout: str = "fail"  # past the timeout: "fail" (a UserError) or "none" (the batch scores None)
    isolate: bool = False  # call it in a worker process, killed past the timeout
    spec: str | None = None  # 'pkg.module:attr', what a worker imports (isolate); load_rewards sets it

    def __post_init__(self) -> None:
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 < t < math.inf):
            raise UserError(
                f"reward {self.name!r}: timeout must be a number of seconds > 0, or None; got {one_line(repr(t))}"
            )
        if self.on_timeout not in ("fail", "none"):
            raise UserError(
                f"reward {self.name!r}: on_timeout must be 'fail' or 'none', got {one_line(repr(self.on_timeout))}"
            )
        if self.isolate and not (isinstance(self.spec, str) and ":" in self.spec):
            raise UserError(
                f"reward {self.name!r}: isolate needs the function's spec ('{SPEC_FORM}'), "
                "to import it in a worker process"
            )


@dataclass
class RewardScores:
    """The scores of one batch of N completions."""

    # (N,) float32: sum of weight * score over the functions that scored the row; NaN if none did
    total: Tensor
    per_function: dict[str, Tensor]  # name -> (N,) float32 unweighted scores, NaN where None


@dataclass
class StepScores:
    """Step rewards of one batch of N completions (process supervision, DeepSeekMath §4.1.3)."""

    # (N,) lists of (end, weighted reward), sorted by end; end len(completion) + 1: a step left out
    steps: list[list[tuple[int, float]]]
    per_function: dict[str, Tensor]  # name -> (N,) mean unweighted step reward, NaN if unscored

    @property
    def total(self) -> Tensor:
        """(N,) float32: the mean step reward of each completion, NaN where it has none."""
        return torch.tensor([sum(r for _, r in s) / len(s) if s else math.nan for s in self.steps], dtype=torch.float32)
