import importlib
import math
import os
import sys
import textwrap

import numpy as np
import pytest
import torch

from grpo.errors import UserError
from grpo.tasks import arithmetic, reasoning_gym
from grpo.rewards import (
    BUILTIN_REWARDS,
    WeightedReward,
    exact_answer,
    load_rewards,
    math_answer,
    r1_format,
    resolve_reward,
    score,
    score_steps,
)

USER_MODULE = """
    def length(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    class Scorer:
        @staticmethod
        def constant(prompts, completions, **columns):
            return [2.0] * len(completions)

        def __call__(self, prompts, completions, **columns):
            return [3.0] * len(completions)

    scorer = Scorer()
    not_a_function = 3
"""


@pytest.fixture
def write_module(tmp_path, monkeypatch):
    """Write tmp_path/<name>.py (or a package) importable for one test."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(relative_path, source):
        path = tmp_path / relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        written.append(relative_path.split("/")[0].removesuffix(".py"))
        importlib.invalidate_caches()

    yield write
    for top in written:
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]


def _raises_one_line(call, *args):
    """The UserError's message, checked to be a single line."""
    with pytest.raises(UserError) as excinfo:
        call(*args)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _reward(fn, name="t:fn", weight=1.0):
    return WeightedReward(name=name, fn=fn, weight=weight)


def _score(fn, completions, columns=None, name="t:fn"):
    return score([_reward(fn, name)], ["Q"] * len(completions), completions, columns or {})


# ---- resolve_reward --------------------------------------------------------------------


def test_builtins_resolve_to_their_functions():
    expected = {
        "exact_answer": exact_answer,
        "math_answer": math_answer,
        "r1_format": r1_format,
        "arithmetic_correct": arithmetic.correctness_reward,
        "arithmetic_format": arithmetic.format_reward,
        "arithmetic_steps": arithmetic.step_reward,
        "reasoning_gym": reasoning_gym.reward,
    }
    assert set(BUILTIN_REWARDS) == set(expected)
    for name, fn in expected.items():
        assert resolve_reward(name) is fn
        assert resolve_reward(BUILTIN_REWARDS[name]) is fn  # a name only stands for its spec


def test_user_function_from_a_module(write_module):
    write_module("user_rw_plain.py", USER_MODULE)
    fn = resolve_reward("user_rw_plain:length")
    assert fn(["Q", "Q"], ["ab", "abcd"]) == [2.0, 4.0]


def test_dotted_attributes_and_packages(write_module):
    write_module("user_rw_pkg/__init__.py", "")
    write_module("user_rw_pkg/rules.py", USER_MODULE)
    assert resolve_reward("user_rw_pkg.rules:Scorer.constant")(["Q"], ["a"]) == [2.0]
    assert resolve_reward("user_rw_pkg.rules:scorer")(["Q"], ["a"]) == [3.0]


def test_a_rewards_file_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "user_rw_cwd.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    # As under the `grpo` console script: neither the directory nor '' is on sys.path.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "user_rw_cwd", raising=False)
    importlib.invalidate_caches()
    try:
        assert resolve_reward("user_rw_cwd:length")(["Q"], ["abc"]) == [3.0]
        assert sys.path[-1] == os.getcwd()  # appended: it never shadows an installed package
    finally:
        sys.modules.pop("user_rw_cwd", None)


def test_unknown_builtin_suggests_the_closest():
    message = _raises_one_line(resolve_reward, "exact_anwser")
    assert message == (
        "unknown reward 'exact_anwser'; did you mean 'exact_answer'? "
        "(built-ins: arithmetic_correct, arithmetic_format, arithmetic_steps, exact_answer, "
        "math_answer, r1_format, reasoning_gym; or give 'pkg.module:function')"
    )


def test_unknown_builtin_far_from_all_lists_them():
    message = _raises_one_line(resolve_reward, "bleu")
    assert message == (
        "unknown reward 'bleu' (built-ins: arithmetic_correct, arithmetic_format, arithmetic_steps, "
        "exact_answer, math_answer, r1_format, reasoning_gym; or give 'pkg.module:function')"
    )


def test_missing_module():
    message = _raises_one_line(resolve_reward, "nosuchpkg_rw.rw:fn")
    assert message == (
        "reward 'nosuchpkg_rw.rw:fn': cannot import module 'nosuchpkg_rw.rw' (No module named 'nosuchpkg_rw')"
    )


def test_module_that_fails_to_import_names_the_error(write_module):
    write_module("user_rw_broken.py", "def fn(:\n    pass\n")
    message = _raises_one_line(resolve_reward, "user_rw_broken:fn")
    assert message.startswith("reward 'user_rw_broken:fn': cannot import module 'user_rw_broken' (SyntaxError: ")


def test_missing_attribute(write_module):
    write_module("user_rw_attr.py", USER_MODULE)
    message = _raises_one_line(resolve_reward, "user_rw_attr:fn")
    assert message == "reward 'user_rw_attr:fn': module 'user_rw_attr' has no attribute 'fn'"
    message = _raises_one_line(resolve_reward, "user_rw_attr:Scorer.nope")
    assert message == "reward 'user_rw_attr:Scorer.nope': 'user_rw_attr:Scorer' has no attribute 'nope'"


def test_not_callable_and_classes_are_rejected(write_module):
    write_module("user_rw_call.py", USER_MODULE)
    message = _raises_one_line(resolve_reward, "user_rw_call:not_a_function")
    assert message == "reward 'user_rw_call:not_a_function': 'not_a_function' is not callable (it is a int)"
    message = _raises_one_line(resolve_reward, "user_rw_call:Scorer")
    assert message.startswith("reward 'user_rw_call:Scorer': 'Scorer' is a class")


@pytest.mark.parametrize("spec", ["user_rw_x:", ":fn"])
def test_half_a_spec_is_rejected(spec):
    assert _raises_one_line(resolve_reward, spec) == f"reward {spec!r}: expected 'pkg.module:function'"


# ---- load_rewards ----------------------------------------------------------------------


def test_load_rewards_keeps_names_unique():
    rewards = load_rewards([("r1_format", 1.0), ("exact_answer", 0.5), ("r1_format", 0), ("r1_format", 2)])
    assert [r.name for r in rewards] == ["r1_format", "exact_answer", "r1_format#2", "r1_format#3"]
    assert [r.weight for r in rewards] == [1.0, 0.5, 0.0, 2.0]
    assert all(r.fn is r1_format for r in rewards if r.name.startswith("r1_format"))
    completions = ["<think>a</think><answer>1</answer>", "no"]
    result = score(rewards, ["Q", "Q"], completions, {"answer": ["1", "1"]})
    assert list(result.per_function) == ["r1_format", "exact_answer", "r1_format#2", "r1_format#3"]
    # 1*1 + 0.5*1 + 0*1 + 2*1 and all zeros.
    torch.testing.assert_close(result.total, torch.tensor([3.5, 0.0]))


def test_load_rewards_checks_every_spec_before_returning():
    message = _raises_one_line(load_rewards, [("r1_format", 1.0), ("exact_anwser", 1.0)])
    assert "unknown reward 'exact_anwser'" in message


@pytest.mark.parametrize(
    "weight, expected",
    [
        (math.nan, "reward 'r1_format': weight must be a finite number, got nan"),
        (math.inf, "reward 'r1_format': weight must be a finite number, got inf"),
        ("1", "reward 'r1_format': weight must be a number, got '1' (str)"),
        (None, "reward 'r1_format': weight must be a number, got None (NoneType)"),
    ],
)
def test_load_rewards_rejects_bad_weights(weight, expected):
    assert _raises_one_line(load_rewards, [("r1_format", weight)]) == expected


# ---- score: combining ------------------------------------------------------------------


def test_two_weighted_functions_by_hand():
    rewards = [
        _reward(lambda p, c, **_: [1.0, 0.0, 0.5, -1.0], "a", weight=2.0),
        _reward(lambda p, c, **_: [3, True, False, 0.25], "b", weight=-0.5),
    ]
    result = score(rewards, ["Q"] * 4, ["w", "x", "y", "z"], {})
    # total = 2 * a - 0.5 * b
    torch.testing.assert_close(result.total, torch.tensor([0.5, -0.5, 1.0, -2.125]))
    torch.testing.assert_close(result.per_function["a"], torch.tensor([1.0, 0.0, 0.5, -1.0]))
    torch.testing.assert_close(result.per_function["b"], torch.tensor([3.0, 1.0, 0.0, 0.25]))
    assert result.total.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in result.per_function.values())


def test_none_is_left_out_not_zero():
    rewards = [
        _reward(lambda p, c, **_: [1.0, None, None, 4.0], "a", weight=2.0),
        _reward(lambda p, c, **_: [3.0, 5.0, None, None], "b", weight=10.0),
    ]
    result = score(rewards, ["Q"] * 4, ["w", "x", "y", "z"], {})
    assert result.total[0].item() == 32.0  # both scored
    assert result.total[1].item() == 50.0  # only b: not 10*5 + 2*0 shifted by anything else
    assert math.isnan(result.total[2].item())  # no function scored it
    assert result.total[3].item() == 8.0  # only a
    assert math.isnan(result.per_function["a"][1].item())
    assert math.isnan(result.per_function["b"][3].item())


def test_zero_weight_still_counts_as_scored():
    result = score([_reward(lambda p, c, **_: [1.0, None], weight=0.0)], ["Q", "Q"], ["x", "y"], {})
    assert result.total[0].item() == 0.0
    assert math.isnan(result.total[1].item())


def test_no_functions_score_nothing():
    assert torch.isnan(score([], ["Q", "Q"], ["x", "y"], {}).total).all()


def test_columns_reach_the_function_row_aligned():
    seen = {}

    def fn(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, **columns)
        return [float(c == t) for c, t in zip(completions, columns["target"])]

    columns = {"target": ["a", "x", "c"], "level": [1, 2, 3]}
    result = score([_reward(fn)], ["P0", "P1", "P2"], ["a", "b", "c"], columns)
    assert seen == {
        "prompts": ["P0", "P1", "P2"],
        "completions": ["a", "b", "c"],
        "target": ["a", "x", "c"],
        "level": [1, 2, 3],
    }
    torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0, 1.0]))


def test_builtins_through_score():
    completions = ["<think>t</think><answer>1,000</answer>", "<answer>3</answer>", "\\boxed{9}"]
    rewards = load_rewards([("exact_answer", 1.0), ("r1_format", 0.5)])
    result = score(rewards, ["Q"] * 3, completions, {"answer": ["1000", "4", None]})
    torch.testing.assert_close(result.per_function["exact_answer"][:2], torch.tensor([1.0, 0.0]))
    assert math.isnan(result.per_function["exact_answer"][2].item())
    torch.testing.assert_close(result.total, torch.tensor([1.5, 0.0, 0.0]))


@pytest.mark.parametrize("make", [np.array, torch.tensor, tuple])
def test_arrays_tensors_and_tuples_are_accepted(make):
    result = _score(lambda p, c, **_: make([0.5, 1.0]), ["x", "y"])
    torch.testing.assert_close(result.total, torch.tensor([0.5, 1.0]))


# ---- score: errors ---------------------------------------------------------------------


def test_a_raising_function_is_reported_with_its_failing_row():
    def fn(prompts, completions, **columns):
        return [1.0 / (len(c) - 3) for c in completions]  # a 3-character completion divides by 0

    completions = ["a", "bb", "cccc", "abc", "ddddd"]
    message = _raises_one_line(_score, fn, completions)
    assert message == "reward 't:fn' raised ZeroDivisionError: float division by zero on row 3 (completion 'abc')"


def test_the_failing_row_gets_its_own_columns_and_a_short_preview():
    def fn(prompts, completions, ok, **_):
        for flag in ok:
            if not flag:
                raise ValueError("boom\nsecond line")
        return [1.0] * len(completions)

    completions = ["fine"] * 2 + ["x" * 100]
    message = _raises_one_line(_score, fn, completions, {"ok": [True, True, False]})
    assert message == (f"reward 't:fn' raised ValueError: boom second line on row 2 (completion '{'x' * 40}...')")


def test_a_batch_only_failure_is_reported_for_the_batch():
    def fn(prompts, completions, **columns):
        if len(completions) > 1:
            raise RuntimeError("batch too large")
        return [1.0]

    message = _raises_one_line(_score, fn, ["a", "b"])
    assert message == (
        "reward 't:fn' raised RuntimeError: batch too large on the batch of 2 completions "
        "(no row failed alone in 2 re-runs of parts of it)"
    )


def test_a_user_error_from_a_function_passes_through_untouched():
    rewards = load_rewards([("exact_answer", 1.0)])
    with pytest.raises(UserError) as excinfo:
        score(rewards, ["Q"], ["<answer>1</answer>"], {"solution": ["1"]})
    assert str(excinfo.value) == "reward 'exact_answer' needs an 'answer' column in the data"


@pytest.mark.parametrize(
    "returned, expected",
    [
        ([1.0] * 7, "reward 't:fn' returned 7 scores for 8 completions"),
        ({"a": 1.0}, "reward 't:fn' returned a dict, not a list of scores"),
        ("1" * 8, "reward 't:fn' returned a str, not a list of scores"),
        (1.0, "reward 't:fn' returned a float, not a list of scores"),
        (None, "reward 't:fn' returned a NoneType, not a list of scores"),
        ([0.0, 1.0, "abc", 0, 0, 0, 0, 0], "reward 't:fn' returned 'abc' (str) for row 2"),
        ([0.0] * 7 + [[1.0]], "reward 't:fn' returned [1.0] (list) for row 7"),
        ([0.0] * 5 + [math.nan, 0, 0], "reward 't:fn' returned nan for row 5; return None for 'cannot score'"),
        ([0.0] * 5 + [-math.inf, 0, 0], "reward 't:fn' returned -inf for row 5; return None for 'cannot score'"),
    ],
)
def test_bad_return_values_are_named(returned, expected):
    message = _raises_one_line(_score, lambda p, c, **_: returned, ["x"] * 8)
    assert message.startswith(expected)


def test_a_column_named_like_an_argument_is_rejected():
    message = _raises_one_line(_score, lambda p, c, **_: [1.0], ["x"], {"completions": ["y"]})
    assert message == "data column 'completions' has the name of a reward-function argument; rename the column"


def test_misaligned_batches_are_a_bug_not_a_user_error():
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        score([], ["Q", "Q"], ["a", "b", "c"], {})
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3 completions"):
        score([], ["Q"] * 3, ["a", "b", "c"], {"answer": ["1", "2"]})


# ---- score_steps: the forms a step verifier returns -------------------------------------


def _steps(returned, completions, weight=1.0):
    """score_steps of one function that returns `returned`, named 't:fn'."""
    fn = _reward(lambda p, c, **_: returned, weight=weight)
    return score_steps([fn], ["Q"] * len(completions), completions, {})


def test_the_plain_forms_are_unchanged():
    completions = ["abcd", "xy", "z", "", "uvw"]
    returned = [[(2, 1.0), (4, 0.0)], 0.5, None, [(0, 1.0)], [(1, None), (3, 1.0)]]
    scored = _steps(returned, completions, weight=2.0)
    assert scored.steps == [[(2, 2.0), (4, 0.0)], [(2, 1.0)], [], [(0, 2.0)], [(3, 2.0)]]
    mean = scored.per_function["t:fn"]  # unweighted, NaN where no steps
    assert mean[[0, 1, 3, 4]].tolist() == [0.5, 0.5, 1.0, 1.0] and math.isnan(mean[2])


def test_left_out_steps_are_added_past_the_text_weighted_like_the_others():
    completions = ["ab;cd", "ab;cd;ef", "abc"]
    returned = [
        {"steps": [(2, 1.0), (5, 1.0)], "expected": 5},  # 3 left out, each 0.0 by default
        {"steps": [(2, 1.0), (5, 1.0)], "expected": 3, "missing": -1},  # 1 left out
        {"steps": [], "expected": 2, "missing": 0.25},  # all left out
    ]
    scored = _steps(returned, completions, weight=2.0)
    assert scored.steps == [
        [(2, 2.0), (5, 2.0), (6, 0.0), (6, 0.0), (6, 0.0)],  # at len + 1: on the EOS, after the last step
        [(2, 2.0), (5, 2.0), (9, -2.0)],
        [(4, 0.5), (4, 0.5)],
    ]
    torch.testing.assert_close(scored.per_function["t:fn"], torch.tensor([0.4, 1 / 3, 0.25]))  # unweighted
    assert _steps([{"steps": [], "expected": 1}], [""]).steps == [[(1, 0.0)]]  # an empty completion's only token


def test_no_padding_when_as_many_or_more_steps_are_given():
    completions = ["ab;cd", "ab;cd", "ab"]
    returned = [
        {"steps": [(2, 1.0), (5, 0.0)], "expected": 1},
        {"steps": [(2, 1.0), (5, None)], "expected": 2},  # an unscored step is not left out
        {"steps": [], "expected": 0},
    ]
    assert _steps(returned, completions).steps == [[(2, 1.0), (5, 0.0)], [(2, 1.0)], []]


@pytest.mark.parametrize(
    "entry, expected",
    [
        (
            {"steps": [], "expected": -1},
            "returned expected=-1 for row 1; expected a whole number of steps in 0..100000",
        ),
        ({"steps": [], "expected": 10**400}, "returned expected=1000000000"),
        ({"steps": [], "expected": 2.0}, "returned expected=2.0 for row 1; expected a whole number"),
        ({"steps": [], "expected": True}, "returned expected=True for row 1; expected a whole number"),
        ({"steps": [], "expected": "3"}, "returned expected='3' for row 1; expected a whole number"),
        ({"steps": [], "expected": 1, "missing": math.nan}, "returned missing=nan for row 1; expected a finite"),
        ({"steps": [], "expected": 1, "missing": math.inf}, "returned missing=inf for row 1; expected a finite"),
        ({"steps": [], "expected": 1, "missing": None}, "returned missing=None for row 1; expected a finite"),
        ({"steps": [], "expected": 1, "missing": "0"}, "returned missing='0' for row 1; expected a finite"),
        ({"steps": [], "expected": 1, "missing": 1e39}, "returned missing=1e+39 for row 1; expected a finite"),
        ({"steps": [], "expected": 1, "Missing": 0.0}, "returned a mapping with unknown key 'Missing' for row 1"),
        ({"steps": []}, "returned a mapping with no 'expected' for row 1"),
        ({"expected": 1}, "returned a mapping with no 'steps' for row 1"),
        ({"steps": [(9, 1.0)], "expected": 1}, "returned step (9, 1.0) for row 1; expected (end, reward)"),
    ],
)
def test_a_bad_mapping_is_named_with_its_row(entry, expected):
    message = _raises_one_line(_steps, [None, entry], ["ab", "ab"])
    assert message.startswith(f"reward 't:fn' {expected}")
