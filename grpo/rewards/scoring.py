"""Scoring a batch with the reward functions: specs resolved to functions before the first step
(`load_rewards`), each called as TRL's GRPOTrainer calls it and contained
(`grpo.infra.contain`), what it returns checked (`as_scores`, in training and evaluation
alike), and the scores combined (`score`; `score_steps` for process supervision).

Why so many checks: a reward function is user code run at every step of a long run, and a
bad value (a NaN, a string, one score short, beyond float32) would otherwise surface steps
later as a NaN loss, far from its cause. Each mistake is one UserError line that names the
function and, where a bisection of the batch finds it (`_raise_for_failing_row`), the row.
None is "not scored", never 0. The calling convention, for users: docs/training.md.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import torch
from torch import Tensor

from grpo.errors import UserError
from grpo.infra import contain
from grpo.infra.imports import builtin_spec, import_callable, one_line, spec_of
from grpo.rewards.logged import LOG_ARGUMENTS, RewardLog
from grpo.rewards.types import SPEC_FORM, RewardFn, RewardScores, StepScores, WeightedReward

__all__ = ["BUILTIN_REWARDS", "as_scores", "load_rewards", "resolve_reward", "score", "score_steps"]

_PREVIEW_CHARS = 40  # of a completion, in an error message
_FLOAT32_MAX = torch.finfo(torch.float32).max  # a score beyond it would be inf in the (N,) tensors
_OPTIONS = ("timeout", "on_timeout", "isolate")  # load_rewards' per-reward options
# A step verifier's per-completion mapping (`score_steps`): required keys first.
_EXPECTED_KEYS = ("steps", "expected", "missing")
# Most steps a completion may be expected to have: beyond any reasoning chain, it stops a
# mistaken count from filling memory with left-out steps.
_MAX_EXPECTED = 100_000
# Names `score` passes itself: a data column of one of these names could not reach the function.
RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", *LOG_ARGUMENTS)


# Built-in name -> the spec it stands for, imported on use. The arithmetic task's rewards are
# named here by their spec only: rewards/ knows no task (a task is a plugin above it).
BUILTIN_REWARDS: dict[str, str] = {
    "exact_answer": "grpo.rewards.rules:exact_answer",
    "math_answer": "grpo.rewards.rules:math_answer",
    "r1_format": "grpo.rewards.rules:r1_format",
    # The built-in arithmetic task: its answer, its shape, and each of its steps.
    "arithmetic_correct": "grpo.tasks.arithmetic:correctness_reward",
    "arithmetic_format": "grpo.tasks.arithmetic:format_reward",
    "arithmetic_steps": "grpo.tasks.arithmetic:step_reward",
    # Rows of a reasoning_gym:NAME data path, scored by that task's own scorer (the gym extra).
    "reasoning_gym": "grpo.tasks.reasoning_gym:reward",
}


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """The function a spec names: a built-in name, or 'pkg.module:attr' (attr may be dotted);
    a function (from Python) is itself.

    A built-in name stands for the spec `BUILTIN_REWARDS` gives it, imported on use. The
    module is imported from sys.path, with the working directory tried last. Raises
    UserError (one line, naming the spec) when the name is unknown, the module cannot be
    imported, the attribute is missing, or what it names is not a function.
    """
    if callable(spec) and not isinstance(spec, str):
        return spec  # given from Python: the function itself
    if not isinstance(spec, str):
        raise UserError(
            f"reward {spec!r}: expected a built-in name, 'pkg.module:function' or a function, "
            f"got a {type(spec).__name__}"
        )
    return import_callable(_target(spec), kind="reward", form=SPEC_FORM)


def _target(spec: str) -> str:
    """The 'pkg.module:attr' a spec names: itself, or the one its built-in name stands for."""
    return spec if ":" in spec else builtin_spec(spec, BUILTIN_REWARDS, kind="reward", form=SPEC_FORM)


def _check_weight(spec: str, weight: Any) -> float:
    if not isinstance(weight, numbers.Real):
        raise UserError(
            f"reward {spec!r}: weight must be a number, got {one_line(repr(weight))} ({type(weight).__name__})"
        )
    # An infinite weight is as broken as NaN: inf * 0 makes the total NaN.
    if not math.isfinite(weight):
        raise UserError(f"reward {spec!r}: weight must be a finite number, got {weight}")
    return float(weight)


def load_rewards(specs: list[tuple[str, float]], options: list[dict[str, Any]] | None = None) -> list[WeightedReward]:
    """Resolve (spec, weight) pairs into WeightedRewards, checking all before any runs.

    Names stay unique, as `RewardScores.per_function` is keyed by them: a spec that appears
    again becomes 'spec#2', 'spec#3', ... A weight of 0 is allowed (log a function's
    scores without training on them); a weight that is not a finite number is a UserError.
    `options`, one dict per spec, sets how its calls are contained: any of `timeout`
    (seconds or None), `on_timeout` ("fail" | "none") and `isolate` (bool), the fields of
    WeightedReward and the keys of the config's rewards[] entries. An isolated function is
    still imported here too, so that a bad spec fails before the first step.
    """
    if options is None:
        options = [{} for _ in specs]
    if len(options) != len(specs):
        raise ValueError(f"got {len(options)} options for {len(specs)} rewards")
    rewards = []
    seen: Counter[str] = Counter()
    for (spec, weight), option in zip(specs, options):
        unknown = sorted(set(option) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"reward {spec!r}: unknown options {unknown} (known: {', '.join(_OPTIONS)})")
        fn = resolve_reward(spec)
        target = spec_of(spec)  # a callable given directly: its 'module:qualname'
        seen[target] += 1
        name = target if seen[target] == 1 else f"{target}#{seen[target]}"
        importable = not callable(spec) or ("<" not in target and ":" in target)  # not a lambda or a local function
        rewards.append(
            WeightedReward(
                name=name,
                fn=fn,
                weight=_check_weight(target, weight),
                spec=_target(target) if importable else None,
                **option,
            )
        )
    return rewards


def _preview(completion: str) -> str:
    """The completion's first characters, quoted on one line."""
    text = str(completion)
    return repr(text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "...")


def _raise_for_failing_row(
    reward: WeightedReward,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    batch_failure: contain.Failed,
    shared: dict[str, Any] | None = None,
) -> NoReturn:
    """Bisect the batch to name a row that makes `reward` fail alone, in a bounded number of
    calls (it may be a paid judge): the first half of the failing range is re-run; if it
    fails, the row is in it, else in the second half (not re-run); the one row left is
    re-run unless it just was. At most ceil(log2 N) + 1 re-runs, each contained as the
    batch's call was; they find the first failing row when rows fail alone. A row is named
    only if it failed alone; else (the failure depends on the batch, or a re-run timed out)
    the batch's error is raised. A timed-out call is not re-run."""

    def rerun(lo: int, hi: int) -> contain.Failed | None:
        try:
            rows = {key: values[lo:hi] for key, values in columns.items()}
            contain.call(reward, prompts[lo:hi], completions[lo:hi], rows, shared)
        except contain.Failed as failure:
            return failure
        except contain.TimedOut:
            return None  # inconclusive: only a row that failed alone is ever named
        return None

    lo, hi, reruns = 0, len(completions), 0
    failure: contain.Failed | None = batch_failure if hi == 1 else None  # that of rows lo..hi-1 alone
    while hi - lo > 1:
        mid = (lo + hi) // 2
        failure, reruns = rerun(lo, mid), reruns + 1
        lo, hi = (lo, mid) if failure else (mid, hi)
    if failure is None and hi - lo == 1:
        failure, reruns = rerun(lo, hi), reruns + 1
    if failure is not None:
        raise UserError(
            f"reward {reward.name!r} {failure.description} on row {lo} (completion {_preview(completions[lo])})"
        ) from failure
    raise UserError(
        f"reward {reward.name!r} {batch_failure.description} on the batch of {len(completions)} completions "
        f"(no row failed alone in {reruns} re-runs of parts of it)"
    ) from batch_failure


def as_scores(name: str, values: Any, n: int, *, kind: str = "reward") -> Tensor:
    """Check what a reward function returned for n completions; (N,) float32, NaN for None.

    The one check of a reward's return value, for training (`score`) and evaluation (a
    reward function as a verifier) alike: a sequence (list, tuple, array, tensor) of n
    values, each a finite number within float32's range or None. Anything else is a one-line UserError that
    starts with `kind` and `name` ("reward 'mypkg:fn' returned ...").
    """
    # Arrays and tensors are not Sequences, but their lists are exactly what was meant.
    if isinstance(values, (np.ndarray, Tensor)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise UserError(
            f"{kind} {name!r} returned a {type(values).__name__}, not a list of scores "
            "(one float or None per completion)"
        )
    if len(values) != n:
        raise UserError(f"{kind} {name!r} returned {len(values)} scores for {n} completions")
    scores = []
    for i, value in enumerate(values):
        if value is None:
            scores.append(math.nan)
            continue
        # numbers.Real includes bool (True -> 1.0) and numpy's scalar types.
        if not isinstance(value, numbers.Real):
            raise UserError(
                f"{kind} {name!r} returned {one_line(repr(value))} ({type(value).__name__}) "
                f"for row {i}; expected a number, or None for 'cannot score'"
            )
        try:
            number = float(value)
        except OverflowError:  # an int beyond even float64's range
            number = None
        if number is not None and not math.isfinite(number):
            raise UserError(f"{kind} {name!r} returned {value} for row {i}; return None for 'cannot score'")
        if number is None or abs(number) > _FLOAT32_MAX:
            raise UserError(f"{kind} {name!r} returned {_huge(value, number)} for row {i}, outside float32's range")
        scores.append(number)
    return torch.tensor(scores, dtype=torch.float32)


def _huge(value: numbers.Real, number: float | None) -> str:
    """A number beyond float32, shown short: '1e+39'; an int past float64 as 'about 1e+400'."""
    if number is not None:
        return f"{number:g}"
    if isinstance(value, numbers.Integral):  # math.log10 takes an int of any size
        return f"about {'-' if value < 0 else ''}1e+{int(math.log10(abs(int(value))))}"
    return one_line(repr(value))


def _run(
    reward: WeightedReward,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    shared: dict[str, Any] | None = None,
    done: contain.Outcome | None = None,
) -> Any:
    """One contained call of `reward` on the batch, or the `done` one's outcome (made by
    `contain.call_concurrently`); a failure is one UserError line."""
    try:
        return contain.call(reward, prompts, completions, columns, shared) if done is None else done.get()
    except contain.TimedOut:
        limit = f"reward {reward.name!r} took longer than {reward.timeout} s (rewards[].timeout)"
        left = "its worker process was killed" if reward.isolate else "the call was abandoned and may still be running"
        if reward.on_timeout == "none":
            print(
                f"grpo: warning: {limit}: it scores None on this batch of {len(completions)} completions ({left})",
                file=sys.stderr,
            )
            return [None] * len(completions)
        raise UserError(
            f"{limit} on a batch of {len(completions)} completions ({left}); raise the timeout, "
            "or set rewards[].on_timeout: none to score such a batch None"
        ) from None
    except contain.Failed as failure:
        _raise_for_failing_row(reward, prompts, completions, columns, failure, shared)


def _call(
    reward: WeightedReward,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    shared: dict[str, Any] | None = None,
    done: contain.Outcome | None = None,
) -> Tensor:
    return as_scores(reward.name, _run(reward, prompts, completions, columns, shared, done), len(completions))


def as_messages(prompts: Sequence[Any], completions: Sequence[str | list]) -> list:
    """Completions as TRL gives them to reward functions: for a conversational prompt (a list
    of messages) the completion is `[{"role": "assistant", "content": text}]`, else the text.
    A completion that is a list of messages already (a multi-turn rollout's turns) is kept."""
    return [
        c if isinstance(p, str) or isinstance(c, list) else [{"role": "assistant", "content": c}]
        for p, c in zip(prompts, completions)
    ]


def _arguments(rewards, prompts, completions, columns, completion_ids, trainer_state, log):
    """The batch as TRL's GRPOTrainer passes it (all by keyword): completions as messages for
    conversational prompts, `completion_ids` (per completion, its tokens up to and including
    EOS) beside the data's columns, and per function what is one for the batch: the
    `trainer_state` and, given a `log`, the function's own `log_metric` and `log_extra`."""
    columns = dict(columns)
    if completion_ids is not None:
        columns["completion_ids"] = completion_ids
    shared = {} if trainer_state is None else {"trainer_state": trainer_state}
    shares = [shared if log is None else {**shared, **log.arguments(r.name)} for r in rewards]
    return as_messages(prompts, completions), columns, shares


def _check_batch(prompts: list, completions: list[str], columns: dict[str, Sequence[Any]]) -> None:
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"got {len(prompts)} prompts for {n} completions; repeat each prompt per completion")
    for key, values in columns.items():
        if key in RESERVED_ARGUMENTS:
            raise UserError(f"data column {key!r} has the name of a reward-function argument; rename the column")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")


def score(
    rewards: list[WeightedReward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
    log: RewardLog | None = None,
) -> RewardScores:
    """Run every reward function on a batch and combine their scores.

    Each is called as TRL's GRPOTrainer calls it, all by keyword:
    `fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns)`,
    completions as message lists for conversational prompts (`as_messages`); a function
    without **kwargs gets only the arguments it names. Given a `log`, each also gets
    `log_metric` and `log_extra`, which write into it (`grpo.rewards.logged`).

    `prompts`, `completions` and every column are row-aligned: row i of each belongs to
    completion i (a prompt repeats once per completion). Returns the raw scores of each
    function (NaN where it returned None) and
        total_i = sum_f weight_f * score_fi   over the f that scored row i   (N,)
    which is NaN where no function scored row i.
    """
    _check_batch(prompts, completions, columns)
    n = len(completions)
    given, columns, shares = _arguments(rewards, prompts, completions, columns, completion_ids, trainer_state, log)
    done = contain.call_concurrently(rewards, prompts, given, columns, shares)  # the async ones, together
    per_function = {r.name: _call(r, prompts, given, columns, shares[i], done.get(i)) for i, r in enumerate(rewards)}
    scores = torch.stack(list(per_function.values())) if rewards else torch.empty(0, n)  # (F, N)
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float32).unsqueeze(1)  # (F, 1)
    scored = ~torch.isnan(scores)  # (F, N)
    weighted = torch.where(scored, weights * scores, torch.zeros_like(scores)).sum(0)  # (N,)
    total = torch.where(scored.any(0), weighted, torch.full_like(weighted, math.nan))  # (N,)
    return RewardScores(total=total, per_function=per_function)


# ---- process supervision: rewards per reasoning step ------------------------------------------


def _as_steps(name: str, values: Any, completions: list[str]) -> list[list[tuple[int, float]] | None]:
    """Check a function's return for process supervision: per completion a number (one step
    ending at the last character), None, a list of (end, reward) with 0 < end <= len + 1 (len + 1: on the EOS; an
    empty completion, an EOS at once, has its steps at 0 or 1, its only token), or a mapping
    {"steps": such a list, "expected": K, "missing": reward}, whose K - len(steps) left-out
    steps are added at len + 1 with the reward `missing` (0.0 by default)."""
    if isinstance(values, (np.ndarray, Tensor)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise UserError(f"reward {name!r} returned a {type(values).__name__}, not one entry per completion")
    if len(values) != len(completions):
        raise UserError(f"reward {name!r} returned {len(values)} scores for {len(completions)} completions")
    out: list[list[tuple[int, float]] | None] = []
    for i, value in enumerate(values):
        if value is None or isinstance(value, numbers.Real):
            out.append(None if value is None else [(len(completions[i]), float(as_scores(name, [value], 1)[0]))])
            continue
        value, expected, missing = _expected(name, value, i) if isinstance(value, Mapping) else (value, 0, 0.0)
        given = value if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) else [value]
        steps = []
        for item in given:
            ok = isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], numbers.Integral)
            empty = len(completions[i]) == 0
            # len + 1: one past the text, on the EOS (a step that includes the choice to stop).
            if not ok or not (0 < item[0] <= len(completions[i]) + 1 or empty and item[0] in (0, 1)):
                raise UserError(
                    f"reward {name!r} returned step {one_line(repr(item))} for row {i}; expected "
                    f"(end, reward) with end a character offset in 1..{len(completions[i]) + 1}"
                )
            reward = float(as_scores(name, [item[1]], 1)[0])
            if not math.isnan(reward):
                steps.append((int(item[0]), reward))
        # A left-out step counts as one with the reward `missing`, past the text (on the token
        # that stopped): stopping early must not escape the later steps' rewards.
        steps += [(len(completions[i]) + 1, missing)] * (expected - len(given))
        out.append(steps or None)
    return out


def _expected(name: str, entry: Mapping, row: int) -> tuple[Any, int, float]:
    """A completion's {"steps", "expected", "missing"} entry, checked: (its steps, how many
    were expected, the reward of each left-out one)."""
    unknown = [key for key in entry if key not in _EXPECTED_KEYS]
    absent = [key for key in _EXPECTED_KEYS[:2] if key not in entry]
    if unknown or absent:
        what = f"unknown key {one_line(repr(unknown[0]))}" if unknown else f"no {absent[0]!r}"
        raise UserError(
            f"reward {name!r} returned a mapping with {what} for row {row}; "
            "expected {'steps': [(end, reward), ...], 'expected': int, 'missing': number (optional)}"
        )
    expected, missing = entry["expected"], entry.get("missing", 0.0)
    if isinstance(expected, bool) or not isinstance(expected, numbers.Integral) or not 0 <= expected <= _MAX_EXPECTED:
        raise UserError(
            f"reward {name!r} returned expected={one_line(repr(expected))} for row {row}; "
            f"expected a whole number of steps in 0..{_MAX_EXPECTED}"
        )
    try:  # as a reward value is checked; None (NaN here) is no reward for a step left out
        number = float(as_scores(name, [missing], 1)[0])
    except UserError:
        number = math.nan
    if math.isnan(number):
        raise UserError(
            f"reward {name!r} returned missing={one_line(repr(missing))} for row {row}; "
            "expected a finite number (the reward of a left-out step)"
        )
    return entry["steps"], int(expected), number


def score_steps(
    rewards: list[WeightedReward],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, Sequence[Any]],
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
    log: RewardLog | None = None,
) -> StepScores:
    """Process supervision: every function's steps, weighted, merged per completion.

    A function of weight 0 is scored for its metric only: its steps are not merged. A function
    may return per completion a list of (end, reward) steps (end = character
    offset one past the step), a single number (one step at the end of the completion: an
    outcome reward beside the process ones), None (no steps), or a mapping that also says
    how many steps it expected:

        {"steps": [(end, reward), ...], "expected": K, "missing": 0.0}

    Each of the K - len(steps) steps the completion left out (none when it gave K or more)
    is added as (len(completion) + 1, missing): a step with the reward `missing` (optional,
    0.0 by default: give the verifier's reward of a wrong step) that ends one past the text,
    which `ProcessBaseline` puts on the completion's last token, its EOS, the token that
    chose to stop. It is weighted like the function's other steps and counts in its mean. A
    step given with the reward None is unscored, not left out.

    Why: `process_advantages` gives a token the normalised rewards of the steps ending at or
    after it. A completion that stops early would otherwise escape its later steps' rewards,
    negative after the group's normalisation whenever they are below its mean, and a policy
    trained so learns to stop after its first step. Scored as wrong steps on the EOS, the
    left-out steps make stopping earn, at every token, what going on wrongly would.
    """
    _check_batch(prompts, completions, columns)
    given, columns, shares = _arguments(rewards, prompts, completions, columns, completion_ids, trainer_state, log)
    merged: list[list[tuple[int, float]]] = [[] for _ in completions]
    per_function = {}
    done = contain.call_concurrently(rewards, prompts, given, columns, shares)  # the async ones, together
    for i, reward in enumerate(rewards):
        steps = _as_steps(reward.name, _run(reward, prompts, given, columns, shares[i], done.get(i)), completions)
        per_function[reward.name] = torch.tensor(
            [sum(r for _, r in s) / len(s) if s else math.nan for s in steps], dtype=torch.float32
        )
        if reward.weight == 0:
            # Watched, not trained on: its steps would still enter the group's normalisation (a
            # step of reward 0 wherever it ends), and a completion that stops before that end
            # would escape it, which rewards stopping (the demo's process arm learned to drop
            # its answer when its weight-0 outcome reward sat at the completion's end).
            continue
        for i, s in enumerate(steps):
            merged[i].extend((end, reward.weight * r) for end, r in s or [])
    return StepScores([sorted(s) for s in merged], per_function)
