"""A user's own task, defined outside `grpo/` as any user would: "avoid a letter".

Each prompt is a short string of a, b and c; its `avoid` column is the prompt's last letter.
A completion's answer is its first character; it is correct when it has one and that is not
the letter to avoid. An untrained model over the test alphabet gets most of them right,
so the tests see non-zero accuracy that no other verifier (arithmetic's, exact_answer)
would give, and answers that no other extractor would read.
"""

from __future__ import annotations

import random

from grpo.tasks import Task

LETTERS = "abc"


def rows(n: int, *, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(LETTERS) for _ in range(3)) for _ in range(n)]
    return [{"prompt": prompt, "avoid": prompt[-1]} for prompt in prompts]


def extract(completion: str) -> str | None:
    """The completion's first character; None for an empty completion."""
    return completion[0] if completion else None


def verify(prompts: list[str], completions: list[str], avoid: list[str] | None = None, **columns) -> list[float | None]:
    """1.0 when the answer exists and is not the row's `avoid` letter; None without the column."""
    if avoid is None:
        return [None] * len(completions)
    return [float(extract(c) is not None and extract(c) != a) for c, a in zip(completions, avoid, strict=True)]


def steps(prompts: list[str], completions: list[str], **columns) -> list[list[tuple[int, float]]]:
    """One step per character: 1.0 when it is a letter of the prompt."""
    return [[(i + 1, float(ch in p)) for i, ch in enumerate(c)] for p, c in zip(prompts, completions, strict=True)]


task = Task(name="avoid", verifier=verify, extract_answer=extract, rows=rows, step_verifier=steps)


def make_task() -> Task:
    """The same task from a function of no arguments, as a spec may name one."""
    return task


# The task without rows: it can only verify the user's own data.
verify_only = Task(name="avoid (verify only)", verifier=verify, extract_answer=extract)

# Mistakes a user can make, for the one-line error tests.
not_a_task = 3


def returns_a_dict() -> dict:
    return {"verifier": verify}


def raises() -> Task:
    raise RuntimeError("no config\nfor this task")


def bad_rows(n: int, *, seed: int) -> list:
    return ["abc"] * n


task_with_bad_rows = Task(name="bad rows", verifier=verify, extract_answer=extract, rows=bad_rows)


def unhashable_answer(completion: str) -> list:
    return list(completion)
