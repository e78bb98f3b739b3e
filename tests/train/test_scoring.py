"""Scoring as a seam: both scorers give the step one shape, a `Scored`."""

import ast
import math
from pathlib import Path

import torch

import grpo.train
from grpo.config import config_from_dict
from grpo.rewards import WeightedReward, score, score_steps
from grpo.train.scorers import OutcomeScorer, ProcessScorer, build_scorer
from grpo.train.seams import Scored

PROMPTS, COMPLETIONS = ["a", "a", "b"], ["12;7", "9", ""]
COLUMNS = {"tag": [0, 0, 1]}


def outcome(prompts, completions, tag, **kwargs):
    return [None if t else float(len(c)) for c, t in zip(completions, tag)]


def steps(prompts, completions, **kwargs):
    return [[(3, 1.0), (4, 0.5)], 0.25, None]  # a process reward, an outcome number, no steps


def test_the_outcome_scorer_gives_the_weighted_sum_and_each_functions_scores():
    rewards = [WeightedReward("len", outcome, 2.0), WeightedReward("other", lambda **k: [1.0, None, 0.5], 1.0)]
    got = OutcomeScorer()(rewards, PROMPTS, COMPLETIONS, COLUMNS, trainer_state=None)
    want = score(rewards, PROMPTS, COMPLETIONS, COLUMNS)
    assert isinstance(got, Scored) and got.steps is None
    torch.testing.assert_close(got.scores, torch.tensor([9.0, 2.0, 0.5]))  # 2 * len + the other; NaN skipped
    torch.testing.assert_close(got.scores, want.total)
    assert list(got.per_function) == ["len", "other"] and math.isnan(float(got.per_function["len"][2]))


def test_the_process_scorer_gives_the_steps_and_their_mean():
    rewards = [WeightedReward("s", steps, 2.0)]
    got = ProcessScorer()(rewards, PROMPTS, COMPLETIONS, COLUMNS)
    assert (
        got.steps == score_steps(rewards, PROMPTS, COMPLETIONS, COLUMNS).steps == [[(3, 2.0), (4, 1.0)], [(1, 0.5)], []]
    )
    torch.testing.assert_close(got.scores, torch.tensor([1.5, 0.5, math.nan]), equal_nan=True)
    torch.testing.assert_close(got.per_function["s"], torch.tensor([0.75, 0.25, math.nan]), equal_nan=True)
    picked = got.select(torch.tensor([1]))  # the step's group filter keeps every field's rows
    assert picked.steps == [[(1, 0.5)]] and picked.per_function["s"].tolist() == [0.25]


def test_the_config_picks_the_scorer_once(make_config):
    assert isinstance(build_scorer(config_from_dict(make_config())), OutcomeScorer)
    process = make_config(
        rewards=[{"function": "tests.train.rewards_for_tests:sevens_steps"}], loss={"supervision": "process"}
    )
    assert isinstance(build_scorer(config_from_dict(process)), ProcessScorer)


def test_the_training_code_asks_no_score_what_it_is():
    """The scorer is chosen at the edge; nothing in grpo/train tells scores apart by type."""
    asking = [
        f"{path.name}:{node.lineno}"
        for path in sorted(Path(grpo.train.__file__).parent.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "isinstance"
        and "Score" in ast.unparse(node.args[1])
    ]
    assert asking == []
