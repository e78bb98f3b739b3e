import sys
import threading

import pytest

from grpo.errors import UserError
from grpo.rewards import exact_answer, extract_answer, math_answer, r1_format


def _prompts(n):
    return ["Q"] * n


# ---- extract_answer --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>41</answer> then <answer> 42 </answer>", "42"),  # the last tag, stripped
        ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
        ("<answer>\\boxed{7}</answer>", "7"),  # a box inside the tag is unwrapped
        ("<answer>9</answer> but \\boxed{8}", "9"),  # the tag wins over a box outside it
        ("\\boxed{1} and finally \\boxed{2}", "2"),
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # nested braces balance
        ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
        ("\\boxed{\\boxed{5}}", "5"),
        ("step #### 3\nmore #### 72", "72"),  # the last '####'
        ("#### 72\nI hope that helps.", "72"),  # only its first line
        ("\\boxed{3} #### 4", "3"),  # a box wins over '####'
        ("The answer is 42.", None),
        ("\\boxed{12", None),  # a truncated box is no answer
        ("<answer>12", None),  # nor is an unclosed tag
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---- exact_answer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<answer>42</answer>", "42"),
        ("<answer>  the   big  dog. </answer>", "the big dog"),  # whitespace, trailing period
        ("\\boxed{1,000}", "1000"),
        ("\\boxed{1000.0}", "1,000"),
        ("#### 1000", "1000.00"),
        ("<answer>-3</answer>", "-3.0"),
        ("<answer>.5</answer>", "0.5"),
        ("<answer>7</answer>", 7),  # a non-string reference
        ("<answer>72</answer>", "She pays 8 * 9 = 72.\n#### 72"),  # GSM8K's raw answer column
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ],
)
def test_exact_answer_matches(completion, gold):
    assert exact_answer(_prompts(1), [completion], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("<answer>43</answer>", "42"),
        ("<answer>1,00</answer>", "100"),  # not a thousands separator: compared as text
        ("<answer>0.5</answer>", "\\frac{1}{2}"),  # exact, not math-equivalent
        ("<answer>Dog</answer>", "dog"),
        ("The answer is 42", "42"),  # nothing extractable
        ("", "42"),
    ],
)
def test_exact_answer_mismatches(completion, gold):
    assert exact_answer(_prompts(1), [completion], answer=[gold]) == [0.0]


def test_exact_answer_without_a_reference_cannot_score():
    scores = exact_answer(_prompts(2), ["<answer>1</answer>", "nothing"], answer=[None, None])
    assert scores == [None, None]


def test_exact_answer_needs_an_answer_column():
    with pytest.raises(UserError) as excinfo:
        exact_answer(_prompts(1), ["<answer>1</answer>"], solution=["1"])
    assert str(excinfo.value) == "reward 'exact_answer' needs an 'answer' column in the data"


# ---- math_answer -----------------------------------------------------------------------


def test_math_answer_is_math_equivalence():
    completions = [
        "The answer is 0.5",
        "so \\boxed{\\frac{2}{4}}",
        "so \\boxed{\\frac{1}{3}}",
        "I cannot solve this.",
        "$x^2 + 1$",
    ]
    golds = ["$\\frac{1}{2}$", "0.5", "0.5", "0.5", "x^2+1"]  # the last one needs the $ retry
    assert math_answer(_prompts(5), completions, answer=golds) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_math_answer_without_a_usable_reference_cannot_score():
    assert math_answer(_prompts(2), ["0.5", "0.5"], answer=[None, "\\text{}"]) == [None, None]


def test_math_answer_needs_an_answer_column():
    with pytest.raises(UserError, match="needs an 'answer' column"):
        math_answer(_prompts(1), ["1"])


def test_math_answer_names_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    with pytest.raises(UserError) as excinfo:
        math_answer(_prompts(1), ["1"], answer=["1"])
    assert "pip install 'grpo[math]'" in str(excinfo.value)


def test_math_answer_works_off_the_main_thread():
    # math_verify's signal.alarm timeouts raise ValueError outside the main thread.
    results = []
    worker = threading.Thread(
        target=lambda: results.append(math_answer(_prompts(2), ["0.5", "2"], answer=["1/2", "3"]))
    )
    worker.start()
    worker.join()
    assert results == [[1.0, 0.0]]


# ---- r1_format -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        "<think>reason</think><answer>42</answer>",
        "  <think>\nreason\n</think>\n\n<answer>\n42\n</answer>\n",
        "<think></think><answer></answer>",
    ],
)
def test_r1_format_accepts(completion):
    assert r1_format(_prompts(1), [completion]) == [1.0]


@pytest.mark.parametrize(
    "completion",
    [
        "Sure! <think>reason</think><answer>42</answer>",  # text before
        "<think>reason</think><answer>42</answer> Done.",  # text after
        "<think>reason</think> so <answer>42</answer>",  # text between
        "<answer>42</answer><think>reason</think>",  # wrong order
        "<think>reason</think>",  # no answer
        "<think>a</think><answer>1</answer><answer>2</answer>",  # two answers
        "<think>a</think><think>b</think><answer>1</answer>",  # two thinks
        "<think>a <answer>1</answer></think><answer>1</answer>",  # a tag inside a block
        "<think>reason<answer>42</answer>",  # think never closed
        "<THINK>reason</THINK><ANSWER>42</ANSWER>",
    ],
)
def test_r1_format_rejects(completion):
    assert r1_format(_prompts(1), [completion]) == [0.0]
