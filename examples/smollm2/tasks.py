"""The real-model walkthrough's task and reward (README, "A real model"): arithmetic questions
as chat prompts for SmolLM2-135M-Instruct, and a rule reward that reads the final number.

    python examples/smollm2/tasks.py OUT_DIR     # writes OUT_DIR/train.jsonl and OUT_DIR/held-out.jsonl

Three kinds of question, a third each: a sum of two one-digit numbers, a product of two
one-digit numbers, a sum of two two-digit numbers. The system message states the answer
format ("Answer with only the final number."). Measured before training (`grpo eval`, 8
samples per question at temperature 0.7, 48 new tokens), the model answers the one-digit
questions right about a third of the time by this reward and the two-digit sums about one
time in sixteen: it knows much of the arithmetic but wanders (restates the question, explains
addition, runs out of tokens before it answers), which is the room RL has here.

Written the way a user writes their own task: a JSONL of chat prompts with an `answer`
column, and a reward function with TRL's signature that reads that column.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

SYSTEM = "Answer with only the final number."
TRAIN_ROWS, HELD_OUT_ROWS = 1000, 90
TRAIN_SEED, HELD_OUT_SEED = 0, 1

_INTEGER = re.compile(r"-?\d+")


def question(rng: random.Random) -> tuple[str, int]:
    """One question and its answer: a one-digit sum, a one-digit product or a two-digit sum."""
    kind = rng.randrange(3)
    if kind == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} + {b}?", a + b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (f"What is {a} + {b}?", a + b) if kind == 0 else (f"What is {a} times {b}?", a * b)


KINDS = {"sum1": "one-digit sums", "product": "one-digit products", "sum2": "two-digit sums"}


def kind(prompt: list[dict]) -> str:
    """Which of KINDS a chat prompt of `rows` asks."""
    a, op, _ = prompt[-1]["content"].removeprefix("What is ").removesuffix("?").split(" ")
    return "product" if op == "times" else "sum2" if len(a) == 2 else "sum1"


def rows(count: int, seed: int) -> list[dict]:
    """`count` rows: a chat prompt (system, user) and the `answer` column, as a string."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        text, answer = question(rng)
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        out.append({"prompt": prompt, "answer": str(answer)})
    return out


def final_number(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer a completion writes is the `answer` column's, else 0.0.

    A completion is TRL's conversational form (a list of messages; the model's turn last) or
    a string. The last integer, not any: a reward for writing the answer anywhere is won by
    listing many numbers."""
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = _INTEGER.findall(text)
        scores.append(float(bool(numbers) and int(numbers[-1]) == int(gold)))
    return scores


def write(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", TRAIN_ROWS, TRAIN_SEED), ("held-out", HELD_OUT_ROWS, HELD_OUT_SEED)):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows(count, seed):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/smollm2/tasks.py OUT_DIR")
    write(Path(sys.argv[1]))
