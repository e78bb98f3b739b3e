"""The real-model walkthrough's task (examples/smollm2/tasks.py): its reward reads the final
number and nothing else, its data is the same on every run and its held-out rows are its own.

What would break silently without it: a reward that pays for listing numbers (the model would
learn to list them, and the README's numbers would measure that), held-out rows drawn from the
training stream, a spec the walkthrough's commands name that no longer resolves.
"""

import json

from examples.smollm2 import tasks
from grpo.rewards import load_rewards


def test_the_reward_reads_the_last_integer_of_a_string_or_of_the_model_s_turn():
    completions = [
        "4 + 3 = 7",
        "The answer is 7, not 8",  # the last number decides
        "7 8 9 10",  # a list that contains the answer is no answer
        "no number at all",
        [{"role": "assistant", "content": "It is -12."}],
        "07",
    ]
    golds = ["7", "7", "7", "7", "-12", "7"]
    assert tasks.final_number(None, completions, golds) == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_the_rows_are_chat_prompts_with_answers_the_same_on_every_call():
    first, again = tasks.rows(60, seed=3), tasks.rows(60, seed=3)
    assert first == again
    for row in first:
        system, user = row["prompt"]
        assert system == {"role": "system", "content": tasks.SYSTEM} and user["role"] == "user"
        a, op, b = user["content"].removeprefix("What is ").removesuffix("?").split(" ")
        assert int(row["answer"]) == (int(a) * int(b) if op == "times" else int(a) + int(b))

    counts = {k: sum(tasks.kind(r["prompt"]) == k for r in tasks.rows(300, seed=0)) for k in tasks.KINDS}
    assert min(counts.values()) > 60  # a third each, roughly


def test_the_written_files_differ_between_train_and_held_out(tmp_path):
    tasks.write(tmp_path)
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "held-out.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (tasks.TRAIN_ROWS, tasks.HELD_OUT_ROWS)

    def two_digit(rows):
        return {
            r["prompt"][1]["content"]
            for r in rows
            if "times" not in r["prompt"][1]["content"] and int(r["answer"]) >= 20
        }

    assert two_digit(held) - two_digit(train)  # unseen two-digit sums among the held-out rows
    assert train[:5] != held[:5]


def test_the_spec_the_walkthrough_names_resolves_as_a_reward():
    (reward,) = load_rewards([("examples.smollm2.tasks:final_number", 1.0)])
    assert reward.fn(prompts=["q", "q"], completions=["= 12", "12 13"], answer=["12", "12"]) == [1.0, 0.0]
