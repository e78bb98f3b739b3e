"""The built-in verifiable task: addition with a worked, column-by-column solution.

A tiny model with a character tokenizer learns it from scratch on a CPU, so it is the demo's
task: `correctness_reward` checks the final answer (outcome supervision) and `step_reward`
every column (process supervision, DeepSeekMath §4.1.3), with no reward model to train.

    "47+85=" -> "7+5+0=12;4+8+1=13>132"

A completion is one fixed-width step 'x+y+c=Cs' per column, ones column first (the column's
digits, 0 where an operand has run out; the carry in; the column's sum as two digits), then
'>' and the answer, nothing else: fixed width lets each step be checked alone. `task`
registers it as a user's task would be: "grpo.tasks.arithmetic:task", built-in "arithmetic".
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo.errors import UserError
from grpo.rewards.rules import text_of
from grpo.tasks.base import Task

__all__ = [
    "ALPHABET",
    "MAX_DIGITS",
    "Problem",
    "correctness_reward",
    "extract_answer",
    "format_reward",
    "is_correct",
    "make_problem",
    "make_rows",
    "parse_prompt",
    "problem_for",
    "step_reward",
    "steps_of",
    "task",
]

ALPHABET = "0123456789+=;>"
STEP_SEPARATOR = ";"
ANSWER_MARKER = ">"
# Longest operand a prompt may have. It keeps int <-> str within Python's 4300-digit limit
# (which would raise ValueError), far above any problem this task is meant for.
MAX_DIGITS = 1000

# [0-9], never \d: \d also matches other scripts' digits ('٣'), which int() would accept.
_PROMPT = re.compile(rf"([0-9]{{1,{MAX_DIGITS}}})\+([0-9]{{1,{MAX_DIGITS}}})=")
_STEP = r"[0-9]\+[0-9]\+[0-9]=[0-9][0-9]"
_SHAPE = re.compile(rf"{_STEP}(?:;{_STEP})*>[0-9]+")
_ANSWER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Problem:
    """One addition problem and its target completion (see the module docstring)."""

    a: int
    b: int
    prompt: str  # "47+85="
    answer: str  # "132"
    solution: str  # "7+5+0=12;4+8+1=13>132": the worked steps, then the answer


def _column_steps(a: int, b: int) -> list[str]:
    """The worked steps of a + b, ones column first: 'x+y+c=Cs' per column."""
    a_digits, b_digits = str(a)[::-1], str(b)[::-1]  # ones digit first
    steps, carry = [], 0
    for k in range(max(len(a_digits), len(b_digits))):
        x = int(a_digits[k]) if k < len(a_digits) else 0
        y = int(b_digits[k]) if k < len(b_digits) else 0
        total = x + y + carry  # 0..19
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return steps


def problem_for(a: int, b: int) -> Problem:
    """The problem a + b with its prompt, answer and worked solution (a, b >= 0)."""
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    answer = str(a + b)
    solution = STEP_SEPARATOR.join(_column_steps(a, b)) + ANSWER_MARKER + answer
    return Problem(a=a, b=b, prompt=f"{a}+{b}=", answer=answer, solution=solution)


def make_problem(rng: random.Random, digits: int = 2) -> Problem:
    """A problem whose operands are drawn uniformly from the `digits`-digit numbers."""
    if not 1 <= digits <= MAX_DIGITS:
        raise UserError(f"arithmetic digits must be between 1 and {MAX_DIGITS}, got {digits}")
    low, high = 10 ** (digits - 1), 10**digits - 1
    return problem_for(rng.randint(low, high), rng.randint(low, high))


def make_rows(n: int, *, seed: int, digits: int | Sequence[int] = 2) -> list[dict]:
    """`n` data rows {"prompt", "answer", "solution"}; the same for the same seed.

    Uses its own `random.Random(seed)`, so the global random state is neither read nor moved.
    Rows are drawn independently: a prompt can repeat (rarely, for 2 digits: 8100 problems).
    `digits` a sequence: row i's operands have digits[i % len(digits)] digits (an even mix),
    and each row carries that length in a `digits` column.
    """
    rng = random.Random(seed)
    if isinstance(digits, int):
        problems = [make_problem(rng, digits) for _ in range(n)]
        return [{"prompt": p.prompt, "answer": p.answer, "solution": p.solution} for p in problems]
    lengths = [digits[i % len(digits)] for i in range(n)]
    return [
        {"prompt": p.prompt, "answer": p.answer, "solution": p.solution, "digits": d}
        for p, d in ((make_problem(rng, d), d) for d in lengths)
    ]


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """(a, b) from a prompt 'A+B=' (exactly that: no spaces, ASCII digits), else None."""
    match = _PROMPT.fullmatch(prompt) if isinstance(prompt, str) else None
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def _split(completion: str) -> tuple[str, str | None]:
    """(steps part, answer part): around the first '>'; the answer part is None without one."""
    body, marker, rest = completion.partition(ANSWER_MARKER)
    return body, (rest if marker else None)


def steps_of(completion: str) -> list[tuple[int, str]]:
    """The completion's steps as (end, text), in order: end is one past the step's last
    character, so `completion[:end].endswith(text)`. The steps are the non-empty pieces
    between ';' before the first '>'; they are returned whether well formed or not."""
    body, _ = _split(completion)
    steps, start = [], 0
    for piece in body.split(STEP_SEPARATOR):
        end = start + len(piece)
        if piece:
            steps.append((end, piece))
        start = end + len(STEP_SEPARATOR)
    return steps


def extract_answer(completion: str) -> str | None:
    """The digits after the first '>' when they are all that follows it, else None."""
    _, rest = _split(completion)
    if rest is None or _ANSWER.fullmatch(rest) is None:
        return None
    return rest


def is_correct(completion: str, answer: str) -> bool:
    """Whether the completion's final answer is `answer` (compared as text, so '0132' is wrong)."""
    return extract_answer(completion) == str(answer).strip()


def _reference(prompt: str) -> str | None:
    parsed = parse_prompt(prompt)
    return None if parsed is None else str(parsed[0] + parsed[1])


def correctness_reward(
    prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 when the completion's final answer is the reference, else 0.0; None: no reference.

    The reference is the `answer` column; without one (answer=None), it is a + b from the
    prompt. Prompts and completions are text, or TRL's conversational message lists.
    """
    golds = [_reference(text_of(p)) for p in prompts] if answer is None else answer
    return [
        None if gold is None else float(is_correct(text_of(completion), gold))
        for completion, gold in zip(completions, golds, strict=True)
    ]


def format_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1.0 when the completion is 'STEP;...;STEP>ANSWER' and nothing else, else 0.0. Shape
    only: it reads no prompt (a skipped column is step_reward's matter), any digits pass."""
    return [float(_SHAPE.fullmatch(text_of(completion)) is not None) for completion in completions]


def _step_rewards(prompt: str, completion: str) -> dict[str, Any]:
    parsed = parse_prompt(prompt)
    # The solution's items: one step per column, then the answer (empty: nothing is right).
    solution = [] if parsed is None else [*_column_steps(*parsed), str(parsed[0] + parsed[1])]
    steps = steps_of(completion)
    # The answer ends the completion, and its EOS is part of it (text after the answer makes it
    # wrong): it sits one past the text, on the EOS, so that stopping inside a wrong answer
    # (">1" for 831) is judged with it instead of escaping with an EOS no item comes after.
    answer = [] if _split(completion)[1] is None else [(len(completion) + 1, extract_answer(completion))]
    items = [(end, float(i < len(solution) and text == solution[i])) for i, (end, text) in enumerate([*steps, *answer])]
    # Expected: the solution's steps (or the completion's, when it wrote more), then an answer.
    return {"steps": items, "expected": max(len(solution) - 1, len(steps)) + 1}


def step_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[dict[str, Any]]:
    """Process supervision: per completion, (end, reward) for each step and then the answer
    when it has one, and how many items were expected, in the form `grpo.rewards.score_steps`
    reads: `{"steps": [(end, reward), ...], "expected": K + 1}` for a K-column problem (more
    when the completion wrote more than K steps), each item left out scored 0.0 there.

    Item i (step i, or the answer after the last step) earns 1.0 when it equals item i of
    the prompt's worked solution, else 0.0: a step must be arithmetically right and the
    column expected there (right digits, right carry in), and the answer right after exactly
    one step per column. The answer's end is `len(completion) + 1`, its EOS (0.0 when it is
    malformed). Items left out score 0.0 on the EOS, the token that chose to stop, so that
    stopping early scores like going on wrongly: without it, the group's normalisation made
    the later items' zeros negative rewards that only the completions which went on paid,
    and a policy learned to stop after the first column. An unparsable prompt: all 0.0.
    """
    return [
        _step_rewards(text_of(prompt), text_of(completion))
        for prompt, completion in zip(prompts, completions, strict=True)
    ]


task = Task(
    name="arithmetic",
    verifier=correctness_reward,
    extract_answer=extract_answer,
    rows=make_rows,
    step_verifier=step_reward,
)
