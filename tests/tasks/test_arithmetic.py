import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.errors import UserError
from grpo.rewards import WeightedReward, score_steps
from grpo.tasks.arithmetic import (
    ALPHABET,
    Problem,
    correctness_reward,
    extract_answer,
    format_reward,
    is_correct,
    make_problem,
    make_rows,
    parse_prompt,
    problem_for,
    step_reward,
    steps_of,
)


@st.composite
def operands(draw):
    """(a, b, digits): two `digits`-digit numbers, digits 1..4."""
    digits = draw(st.integers(1, 4))
    numbers = st.integers(10 ** (digits - 1), 10**digits - 1)
    return draw(numbers), draw(numbers), digits


def _rewards(prompt, completion, answer):
    """(correctness, format, step rewards) of one completion; the step rewards as training
    scores them (`score_steps`): its items, then each item it left out, at len + 1."""
    steps = score_steps([WeightedReward("arithmetic_steps", step_reward, 1.0)], [prompt], [completion], {})
    return (
        correctness_reward([prompt], [completion], answer=[answer])[0],
        format_reward([prompt], [completion])[0],
        steps.steps[0],
    )


# ---- the worked solution ---------------------------------------------------------------


def test_solution_format_by_hand():
    assert problem_for(47, 85) == Problem(a=47, b=85, prompt="47+85=", answer="132", solution="7+5+0=12;4+8+1=13>132")
    assert problem_for(30, 41).solution == "0+1+0=01;3+4+0=07>71"  # fixed width: '=01'
    assert problem_for(99, 1).solution == "9+1+0=10;9+0+1=10>100"  # a short operand pads with 0
    assert problem_for(0, 0).solution == "0+0+0=00>0"


@given(operands())
def test_every_solution_is_verified_correct(case):
    a, b, digits = case
    problem = problem_for(a, b)
    assert problem.answer == str(a + b)
    assert parse_prompt(problem.prompt) == (a, b)
    assert extract_answer(problem.solution) == problem.answer
    assert is_correct(problem.solution, problem.answer)
    correctness, shape, steps = _rewards(problem.prompt, problem.solution, problem.answer)
    assert correctness == 1.0 and shape == 1.0
    # one step per column, then the answer, all right; the answer entry ends the completion, on its EOS
    assert [reward for _, reward in steps] == [1.0] * (digits + 1)
    assert steps[-1][0] == len(problem.solution) + 1
    assert set(problem.prompt + problem.solution) <= set(ALPHABET)


@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_make_problem_draws_operands_of_the_given_width(seed, digits):
    problem = make_problem(random.Random(seed), digits)
    for operand in (problem.a, problem.b):
        assert 10 ** (digits - 1) <= operand <= 10**digits - 1
    assert problem == problem_for(problem.a, problem.b)


def test_two_digit_completions_are_short():
    lengths = [len(problem_for(a, b).solution) for a in range(10, 100) for b in range(10, 100)]
    assert max(lengths) == 21 <= 32
    assert min(lengths) == 20  # 2-digit answers (e.g. 10+10) are one character shorter


def test_bad_digits_and_operands_are_refused():
    with pytest.raises(UserError, match="digits"):
        make_problem(random.Random(0), 0)
    with pytest.raises(ValueError, match="non-negative"):
        problem_for(-1, 5)


# ---- make_rows -------------------------------------------------------------------------


def test_make_rows_is_deterministic_and_varied():
    random.seed(123)
    expected_next = random.random()
    random.seed(123)
    rows = make_rows(200, seed=7)
    assert random.random() == expected_next  # the global random state is untouched
    assert rows == make_rows(200, seed=7)
    assert rows != make_rows(200, seed=8)
    assert len({row["prompt"] for row in rows}) >= 190  # 8100 problems: few repeats
    assert len({row["answer"] for row in rows}) >= 100
    assert make_rows(0, seed=7) == []
    for row in rows:
        assert set(row) == {"prompt", "answer", "solution"}
        a, b = parse_prompt(row["prompt"])
        assert row["answer"] == str(a + b) and row["solution"] == problem_for(a, b).solution
        assert json.loads(json.dumps(row)) == row


def test_make_rows_digits():
    rows = make_rows(50, seed=0, digits=3)
    assert all(all(100 <= x <= 999 for x in parse_prompt(row["prompt"])) for row in rows)
    assert all(set(row["prompt"] + row["solution"]) <= set(ALPHABET) for row in rows)


# ---- parse_prompt ----------------------------------------------------------------------


@given(st.integers(0, 10**12), st.integers(0, 10**12))
def test_parse_prompt_round_trip(a, b):
    assert parse_prompt(f"{a}+{b}=") == (a, b)
    assert parse_prompt(problem_for(a, b).prompt) == (a, b)


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "47+85",
        "47-85=",
        "+85=",
        "47+=",
        "47+85=1",
        " 47+85=",
        "47 + 85 =",
        "٤٧+٨٥=",  # other scripts' digits
        "1" * 1001 + "+1=",  # past MAX_DIGITS: int() would near Python's 4300-digit limit
    ],
)
def test_parse_prompt_rejects(prompt):
    assert parse_prompt(prompt) is None


# ---- hand-written completions for 47+85 (answer 132) -----------------------------------

PROMPT, ANSWER = "47+85=", "132"


@pytest.mark.parametrize(
    "completion, steps, answer, correctness, shape, step_rewards",
    [
        pytest.param(
            "7+5+0=12;4+8+1=13>132",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            "132",
            1.0,
            1.0,
            [(8, 1.0), (17, 1.0), (22, 1.0)],
            id="right",
        ),
        pytest.param(  # the tens column forgets the carry: wrong there and in the answer
            "7+5+0=12;4+8+0=12>122",
            [(8, "7+5+0=12"), (17, "4+8+0=12")],
            "122",
            0.0,
            1.0,
            [(8, 1.0), (17, 0.0), (22, 0.0)],
            id="wrong-carry-in",
        ),
        pytest.param(  # the ones column drops its carry out; the tens step is still right
            "7+5+0=02;4+8+1=13>132",
            [(8, "7+5+0=02"), (17, "4+8+1=13")],
            "132",
            1.0,
            1.0,
            [(8, 0.0), (17, 1.0), (22, 1.0)],
            id="wrong-carry-out",
        ),
        pytest.param(  # a wrong sum digit
            "7+5+0=13;4+8+1=13>133",
            [(8, "7+5+0=13"), (17, "4+8+1=13")],
            "133",
            0.0,
            1.0,
            [(8, 0.0), (17, 1.0), (22, 0.0)],
            id="wrong-sum-digit",
        ),
        pytest.param(  # arithmetically right, but not this problem's ones column
            "7+6+0=13;4+8+1=13>133",
            [(8, "7+6+0=13"), (17, "4+8+1=13")],
            "133",
            0.0,
            1.0,
            [(8, 0.0), (17, 1.0), (22, 0.0)],
            id="wrong-operand-digit",
        ),
        pytest.param(  # right steps, wrong final answer
            "7+5+0=12;4+8+1=13>123",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            "123",
            0.0,
            1.0,
            [(8, 1.0), (17, 1.0), (22, 0.0)],
            id="wrong-answer",
        ),
        pytest.param(  # the tens step skipped: the answer is right but out of place
            "7+5+0=12>132",
            [(8, "7+5+0=12")],
            "132",
            1.0,
            1.0,
            [(8, 1.0), (13, 0.0), (13, 0.0)],  # the tens step left out: 0.0 past the end
            id="missing-last-step",
        ),
        pytest.param(  # the ones step skipped: the tens step sits where the ones step goes
            "4+8+1=13>132",
            [(8, "4+8+1=13")],
            "132",
            1.0,
            1.0,
            [(8, 0.0), (13, 0.0), (13, 0.0)],
            id="missing-first-step",
        ),
        pytest.param(  # an extra step: it and the answer after it are out of place
            "7+5+0=12;4+8+1=13;0+0+1=01>132",
            [(8, "7+5+0=12"), (17, "4+8+1=13"), (26, "0+0+1=01")],
            "132",
            1.0,
            1.0,
            [(8, 1.0), (17, 1.0), (26, 0.0), (31, 0.0)],
            id="extra-step",
        ),
        pytest.param(  # text after the answer makes it malformed
            "7+5+0=12;4+8+1=13>132;",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            None,
            0.0,
            0.0,
            [(8, 1.0), (17, 1.0), (23, 0.0)],
            id="trailing-text",
        ),
        pytest.param(
            "7+5+0=12;4+8+1=13>132>132",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            None,
            0.0,
            0.0,
            [(8, 1.0), (17, 1.0), (26, 0.0)],
            id="second-answer",
        ),
        pytest.param(  # truncated mid-step: the answer left out scores 0.0 past the end
            "7+5+0=12;4+8",
            [(8, "7+5+0=12"), (12, "4+8")],
            None,
            0.0,
            0.0,
            [(8, 1.0), (12, 0.0), (13, 0.0)],
            id="truncated",
        ),
        pytest.param(  # all the steps right but stopped before the answer: not a full score
            "7+5+0=12;4+8+1=13",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            None,
            0.0,
            0.0,
            [(8, 1.0), (17, 1.0), (18, 0.0)],
            id="no-answer",
        ),
        pytest.param(  # everything left out: on its only token, the EOS
            "",
            [],
            None,
            0.0,
            0.0,
            [(1, 0.0), (1, 0.0), (1, 0.0)],
            id="empty",
        ),
        pytest.param(  # an answer with no steps: out of place, and two items left out
            ">132",
            [],
            "132",
            1.0,
            0.0,
            [(5, 0.0), (5, 0.0), (5, 0.0)],
            id="answer-only",
        ),
        pytest.param(  # empty pieces are not steps
            "9;;+=>>",
            [(1, "9"), (5, "+=")],
            None,
            0.0,
            0.0,
            [(1, 0.0), (5, 0.0), (8, 0.0)],
            id="garbage",
        ),
        pytest.param(  # the step padded its sum with a space: not a step of this task
            "7+5+0=12;4+8+1= 13>132",
            [(8, "7+5+0=12"), (18, "4+8+1= 13")],
            "132",
            1.0,
            0.0,
            [(8, 1.0), (18, 0.0), (23, 1.0)],
            id="space-in-step",
        ),
        pytest.param(  # digits of another script are not digits here
            "7+5+0=12;4+8+1=13>١٣٢",
            [(8, "7+5+0=12"), (17, "4+8+1=13")],
            None,
            0.0,
            0.0,
            [(8, 1.0), (17, 1.0), (22, 0.0)],
            id="non-ascii-digits",
        ),
    ],
)
def test_hand_written_completions(completion, steps, answer, correctness, shape, step_rewards):
    assert steps_of(completion) == steps
    assert extract_answer(completion) == answer
    assert is_correct(completion, ANSWER) == (correctness == 1.0)
    assert _rewards(PROMPT, completion, ANSWER) == (correctness, shape, step_rewards)


def test_leading_zeros_in_the_answer_are_wrong():
    assert extract_answer("7+5+0=12;4+8+1=13>0132") == "0132"
    assert not is_correct("7+5+0=12;4+8+1=13>0132", "132")


# ---- the reward functions on a batch ---------------------------------------------------


def test_correctness_reward_references():
    right, wrong = "7+5+0=12;4+8+1=13>132", "7+5+0=12;4+8+1=13>131"
    prompts = [PROMPT] * 3
    assert correctness_reward(prompts, [right, wrong, right], answer=["132", "132", None]) == [
        1.0,
        0.0,
        None,  # a row without a reference cannot be scored
    ]
    assert correctness_reward([PROMPT], [right], answer=[132]) == [1.0]  # a number column
    assert correctness_reward([PROMPT], [right], answer=["999"]) == [0.0]  # the column wins
    # no answer column: the prompt is the reference; an unparsable prompt cannot be scored
    assert correctness_reward([PROMPT, PROMPT, "47 plus 85"], [right, wrong, right]) == [
        1.0,
        0.0,
        None,
    ]
    with pytest.raises(ValueError):  # a column that does not match the batch is a bug
        correctness_reward([PROMPT] * 2, [right, right], answer=["132"])


def test_step_reward_needs_a_parsable_prompt():
    assert step_reward(["what is 47+85?"] * 2, ["7+5+0=12;4+8+1=13>132", "7+5+0=12"]) == [
        {"steps": [(8, 0.0), (17, 0.0), (22, 0.0)], "expected": 3},
        {"steps": [(8, 0.0)], "expected": 2},  # the answer is still expected
    ]


def test_step_reward_says_how_many_items_it_expected():
    completions = ["7+5+0=12", "7+5+0=12;4+8+1=13;0+0+1=01", "7+5+0=12;4+8+1=13;0+0+1=01>132"]
    assert step_reward([PROMPT] * 3, completions) == [
        {"steps": [(8, 1.0)], "expected": 3},  # 2 columns, then the answer
        {"steps": [(8, 1.0), (17, 1.0), (26, 0.0)], "expected": 4},  # after an extra step, an answer
        {"steps": [(8, 1.0), (17, 1.0), (26, 0.0), (31, 0.0)], "expected": 4},
    ]


def test_step_reward_batch_and_other_widths():
    prompts = ["5+123=", "999+1="]
    completions = ["5+3+0=08;0+2+0=02;0+1+0=01>128", problem_for(999, 1).solution]
    assert problem_for(999, 1).solution == "9+1+0=10;9+0+1=10;9+0+1=10>1000"
    assert step_reward(prompts, completions) == [
        {"steps": [(8, 1.0), (17, 1.0), (26, 1.0), (31, 1.0)], "expected": 4},
        {"steps": [(8, 1.0), (17, 1.0), (26, 1.0), (32, 1.0)], "expected": 4},
    ]
    assert format_reward(prompts, completions) == [1.0, 1.0]


# ---- any string: well defined, never raises --------------------------------------------

_TEXT = st.text(alphabet=ALPHABET, max_size=40) | st.text(max_size=20)


@given(_TEXT, st.sampled_from([PROMPT, "5+123=", "", "garbage"]) | _TEXT)
def test_any_string_gives_a_well_defined_result(completion, prompt):
    steps = steps_of(completion)
    ends = [end for end, _ in steps]
    assert ends == sorted(set(ends))
    for end, text in steps:
        assert text and 0 < end <= len(completion) and completion[:end].endswith(text)
        assert ";" not in text and ">" not in text
    answer = extract_answer(completion)
    assert answer is None or (answer.isascii() and answer.isdigit())

    correctness, shape, rewards = _rewards(prompt, completion, ANSWER)
    assert correctness in (0.0, 1.0) and shape in (0.0, 1.0)
    assert correctness_reward([prompt], [completion])[0] in (0.0, 1.0, None)
    parsed = parse_prompt(prompt)
    columns = 0 if parsed is None else len(steps_of(problem_for(*parsed).solution))
    given = len(steps) + (">" in completion)  # its steps, then its answer entry when it has a '>'
    assert [end for end, _ in rewards[: len(steps)]] == ends
    assert [end for end, _ in rewards[len(steps) : given]] == [len(completion) + 1] * (given - len(steps))
    assert len(rewards) == max(columns, len(steps)) + 1  # every item expected: given, or left out
    assert [end for end, _ in rewards[given:]] == [len(completion) + 1] * (len(rewards) - given)
    assert all(reward in (0.0, 1.0) for _, reward in rewards)
    if shape == 1.0:
        assert steps and answer is not None and all(len(text) == 8 for _, text in steps)
    parse_prompt(completion)  # nor does a garbage prompt raise
