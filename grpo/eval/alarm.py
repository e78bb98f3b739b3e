"""The reward-hacking alarm: the training reward climbs while the held-out metric falls.

A reward that can be gamed (one that pays length, a format, a judge's quirk) rises while the
task it stands for gets worse; the training reward alone cannot tell. After each in-loop
evaluation the run hands the alarm the training reward's mean since the previous evaluation
and the held-out metric with its 95% interval; over the last `window` evaluations it fires when
both hold:

- the training reward rises: its least-squares slope against the step is > 0 and its last
  value exceeds its first. The slope alone follows one outlier; last > first alone ignores
  the points between; together, a rise that is neither a single spike nor a dip at the end.
- the held-out metric falls beyond its intervals: from the window's first evaluation to its
  last it drops by more than sqrt(h_first^2 + h_last^2), the two 95% half-widths combined as
  those of two independent means (a one-sided test of the difference at 2.5%), and its slope
  is < 0. The evaluations reuse the same problems and sampling seed, so two of them differ
  by less noise than independent draws would: the bar is conservative. A drop beyond the
  latest half-width alone fires on noise more often; disjoint intervals (h_first + h_last)
  miss a collapse on a small held-out set.

It warns once when it rises (the condition holding where it did not at the previous
evaluation) and re-arms once the condition clears; `alarm/reward_hacking` is 1 while it holds.
The reward of the evaluation at step 0 is None (no step yet): that evaluation still gives the
metric's starting point. The user's guide: docs/evaluation.md.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from grpo.eval.metrics import fell_beyond, slope

__all__ = ["Alarm", "METRIC"]

METRIC = "alarm/reward_hacking"


@dataclass
class _Point:
    step: int
    reward: float | None  # the training reward's mean since the previous evaluation
    metric: float
    lo: float
    hi: float

    def half(self) -> float:
        """The interval's half-width: its wider side (the runner clips intervals to [0, 1])."""
        return max(self.hi - self.metric, self.metric - self.lo)


class Alarm:
    """Compares the training reward's trend with a held-out metric over the last `window`
    evaluations (see the module docstring). `record` takes each training step's reward,
    `update` each evaluation's metric; `state_dict` survives --resume with the checkpoint."""

    def __init__(self, window: int, metric: str = "eval/pass@1"):
        if window < 2:
            raise ValueError(f"window must be at least 2 evaluations, got {window}")
        self.window, self.metric = window, metric
        self.points: list[_Point] = []
        self.firing = False
        self.reward_sum, self.reward_count = 0.0, 0  # the steps since the previous evaluation

    def record(self, reward: float | None) -> None:
        """A training step's reward (reward/mean; None where nothing scored: skipped)."""
        if reward is not None and reward == reward:  # NaN: nothing to average
            self.reward_sum += float(reward)
            self.reward_count += 1

    def recent(self) -> float | None:
        """The mean of the rewards recorded since the previous `update` (None: none)."""
        return self.reward_sum / self.reward_count if self.reward_count else None

    def update(self, step: int, train_reward: float | None, metric: float, interval: tuple[float, float]) -> str | None:
        """One evaluation at `step`: the training reward's mean since the previous one (None
        where no step ran, as at step 0), the held-out metric and its 95% interval. Returns the
        warning line when the alarm rises here, else None."""
        lo, hi = interval
        self.points = [*self.points, _Point(int(step), train_reward, float(metric), float(lo), float(hi))]
        self.points = self.points[-self.window :]
        self.reward_sum, self.reward_count = 0.0, 0
        was, self.firing = self.firing, self.diverging()
        return self.warning() if self.firing and not was else None

    def diverging(self) -> bool:
        """Whether, over the window, the reward rises while the metric falls beyond its interval."""
        if len(self.points) < self.window:
            return False
        paid = [p for p in self.points if p.reward is not None]
        if len(paid) < 2:
            return False
        rewards = [p.reward for p in paid]
        rising = slope([p.step for p in paid], rewards) > 0 and rewards[-1] > rewards[0]
        first, last = self.points[0], self.points[-1]
        trend = slope([p.step for p in self.points], [p.metric for p in self.points])
        falling = fell_beyond(first.metric, first.half(), last.metric, last.half()) and trend < 0
        return rising and falling

    def warning(self) -> str:
        """The line that says what diverged, between which values, over which evaluations."""
        paid = [p for p in self.points if p.reward is not None]
        first, last = self.points[0], self.points[-1]
        return (
            f"grpo: warning: step {last.step}: possible reward hacking: the training reward rose "
            f"{paid[0].reward:.3g} -> {paid[-1].reward:.3g} over the last {len(self.points)} evaluations "
            f"(steps {first.step}-{last.step}) while {self.metric} fell {first.metric:.3g} -> {last.metric:.3g} "
            f"(beyond its 95% intervals: [{first.lo:.3g}, {first.hi:.3g}] then [{last.lo:.3g}, {last.hi:.3g}])"
        )

    def metrics(self) -> dict[str, float]:
        """`alarm/reward_hacking`: 1.0 while the alarm holds, else 0.0."""
        return {METRIC: float(self.firing)}

    def state_dict(self) -> dict:
        """Plain data for a checkpoint: the window's evaluations, whether it holds, and the
        rewards recorded since the last evaluation."""
        return {
            "points": [list(astuple(p)) for p in self.points],
            "firing": self.firing,
            "reward_sum": self.reward_sum,
            "reward_count": self.reward_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.points = [_Point(*p) for p in state["points"]][-self.window :]
        self.firing = bool(state["firing"])
        self.reward_sum, self.reward_count = float(state["reward_sum"]), int(state["reward_count"])
