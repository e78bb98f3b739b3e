"""`grpo compare`: the same data and budget for both runs, and a side-by-side table."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from grpo import compare as compare_module
from grpo.cli import main
from grpo.compare import aligned_configs, format_table
from grpo.rewards.rules import extract_answer
from grpo.tasks import Task
from tests.tasks import user_task

# The user's "avoid a letter" task with the built-in answer reader: the tiny models' answers
# (a first character) are in no format it reads (<answer>, \boxed{}, ####).
unread = Task(
    name="avoid, answers unread", verifier=user_task.verify, extract_answer=extract_answer, rows=user_task.rows
)


def explodes(completion):
    """An answer extractor that raises, as a user's buggy one would."""
    raise ValueError("cannot read this")


def test_second_config_takes_the_first_ones_data_and_budget():
    a = {
        "seed": 1,
        "data": {"path": "a.jsonl", "prompt_column": "q", "split": "train", "task_options": {}},
        "train": {"steps": 10, "lr": 1.0},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 8, "group_size": 8},
    }
    b = {
        "seed": 2,
        "data": {"path": "b.jsonl", "prompt_column": "q", "split": "train", "task_options": {}},
        "train": {"steps": 20, "lr": 2.0},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 8, "group_size": 1},
    }
    aligned, changed = aligned_configs(a, b)
    assert aligned["data"]["path"] == "a.jsonl" and aligned["seed"] == 1 and aligned["train"]["steps"] == 10
    assert aligned["train"]["lr"] == 2.0 and aligned["rollout"]["group_size"] == 1  # what B is about stays
    assert changed == ["data.path: 'b.jsonl' -> 'a.jsonl'", "seed: 2 -> 1", "train.steps: 20 -> 10"]
    assert b["data"]["path"] == "b.jsonl"  # the caller's mapping is not modified


def test_table_formats_every_row_and_marks_missing_numbers():
    run = {
        "models": 3,
        "parameters": 1234567,
        "peak_memory_mb": 512.4,
        "generated_tokens": 1000,
        "time_per_step_s": 0.25,
        "time_s": 10.0,
        "reward/final": 0.5,
        "accuracy": None,
    }
    table = format_table(["A", "B"], [run, {**run, "models": 4}])
    assert "| models held | 3 | 4 |" in table
    assert "| parameters held | 1,234,567 | 1,234,567 |" in table
    assert "| accuracy (pass@1) | n/a | n/a |" in table
    assert "| majority vote (maj@n) | n/a | n/a |" in table
    table = format_table(["A", "B"], [{**run, "maj@n": 0.25}, run], n=8)
    assert "| majority vote (maj@8) | 0.250 | n/a |" in table


@pytest.mark.slow
def test_compare_grpo_and_ppo_configs(capsys, make_config, tmp_path):
    grpo_path, ppo_path = tmp_path / "grpo.yaml", tmp_path / "ppo.yaml"
    grpo_path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    ppo = make_config("ppo", train={"steps": 3})
    ppo["data"]["path"] = "elsewhere.jsonl"
    ppo_path.write_text(yaml.safe_dump(ppo))
    code = main(
        [
            "compare",
            str(grpo_path),
            str(ppo_path),
            "--output",
            str(tmp_path / "cmp"),
            "--quiet",
            "--task",
            "tests.tasks.user_task:task",
            "--n",
            "2",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "train.steps: 3 -> 2" in out and "| models held | 3 | 4 |" in out
    summary = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    grpo_run, ppo_run = summary["runs"]
    assert grpo_run["steps"] == ppo_run["steps"] == 2
    assert ppo_run["parameters"] > grpo_run["parameters"]  # the value model
    assert grpo_run["generated_tokens"] > ppo_run["generated_tokens"]  # G samples per prompt vs 1
    # Measured by the user's task (tests/tasks/user_task.py) on rows it generates: nearly any
    # first character is right there, while the arithmetic task would give these models 0.
    assert all(0.5 < run["accuracy"] <= 1.0 for run in (grpo_run, ppo_run))
    # Evaluated as `grpo eval` does: maj@n with the task's answers (all but empty samples have one).
    assert all(
        run["eval"]["pass@k"]["1"] == run["accuracy"]
        and run["maj@n"] == run["eval"]["maj@k"]["2"] > 0
        and run["no_answer"] < 0.5
        for run in (grpo_run, ppo_run)
    )
    assert summary["n"] == 2 and summary["warnings"] == []
    assert (tmp_path / "cmp" / "compare.md").read_text().startswith("# A: grpo vs B: ppo")


def test_a_wrong_task_fails_before_either_run_trains(capsys, make_config, tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    out = tmp_path / "cmp"
    for task, message in [
        (
            "mypkg_nowhere.tasks:mytask",
            "grpo: error: compare --task: task 'mypkg_nowhere.tasks:mytask': cannot import "
            "module 'mypkg_nowhere.tasks' (No module named 'mypkg_nowhere')",
        ),
        (
            "tests.tasks.user_task:verify_only",
            "grpo: error: compare: task 'avoid (verify only)' generates no rows; give --eval-data",
        ),
    ]:
        assert main(["compare", str(path), str(path), "--output", str(out), "--quiet", "--task", task]) == 2
        assert capsys.readouterr().err == message + "\n"
        assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--task", "arithmetic", "--answer", "tests.tasks.user_task:nope"],
            "grpo: error: --answer 'tests.tasks.user_task:nope': module 'tests.tasks.user_task' has no attribute 'nope'",
        ),
        (
            ["--task", "arithmetic", "--answer", "tests.test_compare:explodes"],
            "grpo: error: answer extractor 'tests.test_compare:explodes' raised ValueError: cannot read this on "
            "completion ''",
        ),
        (
            ["--task", "arithmetic", "--answer-pattern", "([a-"],
            "grpo: error: --answer-pattern: not a regular expression (unterminated character set at position 1)",
        ),
        (
            ["--answer", "tests.tasks.user_task:extract"],
            "grpo: error: compare: --answer and --answer-pattern read the answers of the evaluation; give --task too",
        ),
    ],
)
def test_a_bad_answer_extractor_fails_before_either_run_trains(
    capsys, make_config, tmp_path, monkeypatch, argv, message
):
    def no_training(*args, **kwargs):
        raise AssertionError("nothing may train when the arguments are wrong")

    monkeypatch.setattr(compare_module, "train_in_child", no_training)
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    out = tmp_path / "cmp"
    assert main(["compare", str(path), str(path), "--output", str(out), "--quiet", *argv]) == 2
    assert capsys.readouterr().err == message + "\n"
    assert not out.exists()


@pytest.fixture
def trained_instantly(monkeypatch, tiny_model):
    """train_in_child replaced by a copy of the tiny model as each run's final/: what is
    tested is the evaluation of the runs, not their training."""

    def fake(config, config_path, *, progress=True):
        shutil.copytree(tiny_model, Path(config["output_dir"]) / "final")
        return {"models": 3, "steps": 2, "metrics": []}

    monkeypatch.setattr(compare_module, "train_in_child", fake)


@pytest.mark.slow
def test_answers_no_extractor_reads_are_said_and_a_users_extractor_reads_them(
    capsys, make_config, tmp_path, trained_instantly
):
    """The task's verifier marks most samples right, but its answer reader finds none: maj@n
    would be a silent 0. A warning line says so (stderr, compare.md, compare.json);
    --answer with the user's reader gives the votes, and maj@n is no longer 0."""
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    common = [str(path), str(path), "--quiet", "--task", "tests.test_compare:unread", "--n", "4"]

    assert main(["compare", *common, "--output", str(tmp_path / "unread")]) == 0
    err = capsys.readouterr().err
    summary = json.loads((tmp_path / "unread" / "compare.json").read_text())
    for name, run in zip(("A: grpo", "B: grpo"), summary["runs"]):
        assert run["accuracy"] > 0.5 and run["maj@n"] == 0.0 and run["no_answer"] == 1.0
        warning = (
            f"grpo compare: warning: {name}: no final answer found in 100% of the samples, so maj@k has "
            "few votes to count; say how to read the answer with --answer or --answer-pattern"
        )
        assert warning in err.splitlines() and warning in summary["warnings"]
        assert warning in (tmp_path / "unread" / "compare.md").read_text()
    assert "| majority vote (maj@4) | 0.000 | 0.000 |" in summary["table"]

    assert (
        main(["compare", *common, "--output", str(tmp_path / "read"), "--answer", "tests.tasks.user_task:extract"]) == 0
    )
    assert "warning" not in capsys.readouterr().err
    summary = json.loads((tmp_path / "read" / "compare.json").read_text())
    assert summary["warnings"] == []
    assert all(run["maj@n"] > 0.5 and run["no_answer"] < 0.5 for run in summary["runs"])  # empty samples: none
    assert "warning" not in (tmp_path / "read" / "compare.md").read_text()

    # A pattern does the same: the first character of the completion.
    assert main(["compare", *common, "--output", str(tmp_path / "pattern"), "--answer-pattern", r"^(\S)"]) == 0
    summary = json.loads((tmp_path / "pattern" / "compare.json").read_text())
    assert all(run["maj@n"] > 0.5 for run in summary["runs"])


@pytest.mark.parametrize("what", ["sampler", "installed"])
def test_a_refused_second_config_fails_before_the_first_trains(capsys, make_config, tmp_path, monkeypatch, what):
    """B's refusals (its decoder's, a package its engines need) are one line before A trains."""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    if what == "sampler":
        b.write_text(yaml.safe_dump(make_config(train={"steps": 2}, rollout={"sampler": "hf", "draw": "fast"})))
        expected = "rollout.draw"
    else:
        b.write_text(yaml.safe_dump(make_config(train={"steps": 2}, lora={"r": 4, "quantize": "nf4"})))
        monkeypatch.setattr("grpo.train.preflight.quantize_missing", lambda q: None if q == "none" else "no bnb here")
        expected = "no bnb here"
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo: error: ") and expected in err and len(err.splitlines()) == 1
    assert not out.exists()
