"""`grpo compare`: the same data and budget for both runs, and a side-by-side table."""

import json

import yaml

from grpo.cli import main
from grpo.compare import aligned_configs, format_table


def test_second_config_takes_the_first_ones_data_and_budget():
    a = {"seed": 1, "data": {"path": "a.jsonl", "prompt_column": "q", "split": "train", "task_options": {}},
         "train": {"steps": 10, "lr": 1.0}, "rollout": {"prompts_per_step": 4, "max_new_tokens": 8, "group_size": 8}}
    b = {"seed": 2, "data": {"path": "b.jsonl", "prompt_column": "q", "split": "train", "task_options": {}},
         "train": {"steps": 20, "lr": 2.0}, "rollout": {"prompts_per_step": 4, "max_new_tokens": 8, "group_size": 1}}
    aligned, changed = aligned_configs(a, b)
    assert aligned["data"]["path"] == "a.jsonl" and aligned["seed"] == 1 and aligned["train"]["steps"] == 10
    assert aligned["train"]["lr"] == 2.0 and aligned["rollout"]["group_size"] == 1  # what B is about stays
    assert changed == ["data.path: 'b.jsonl' -> 'a.jsonl'", "seed: 2 -> 1", "train.steps: 20 -> 10"]
    assert b["data"]["path"] == "b.jsonl"  # the caller's mapping is not modified


def test_table_formats_every_row_and_marks_missing_numbers():
    run = {"models": 3, "parameters": 1234567, "peak_memory_mb": 512.4, "generated_tokens": 1000,
           "time_per_step_s": 0.25, "time_s": 10.0, "reward/final": 0.5, "accuracy": None}
    table = format_table(["A", "B"], [run, {**run, "models": 4}])
    assert "| models held | 3 | 4 |" in table
    assert "| parameters held | 1,234,567 | 1,234,567 |" in table
    assert "| accuracy (pass@1) | n/a | n/a |" in table


def test_compare_grpo_and_ppo_configs(capsys, make_config, tmp_path):
    grpo_path, ppo_path = tmp_path / "grpo.yaml", tmp_path / "ppo.yaml"
    grpo_path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    ppo = make_config("ppo", train={"steps": 3})
    ppo["data"]["path"] = "elsewhere.jsonl"
    ppo_path.write_text(yaml.safe_dump(ppo))
    code = main(["compare", str(grpo_path), str(ppo_path), "--output", str(tmp_path / "cmp"), "--quiet",
                 "--task", "tests.tasks.user_task:task", "--n", "2"])
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
    assert (tmp_path / "cmp" / "compare.md").read_text().startswith("# A: grpo vs B: ppo")


def test_a_wrong_task_fails_before_either_run_trains(capsys, make_config, tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(make_config(train={"steps": 2})))
    out = tmp_path / "cmp"
    for task, message in [
        ("mypkg_nowhere.tasks:mytask", "grpo: error: compare --task: task 'mypkg_nowhere.tasks:mytask': cannot import "
                                       "module 'mypkg_nowhere.tasks' (No module named 'mypkg_nowhere')"),
        ("tests.tasks.user_task:verify_only", "grpo: error: compare: task 'avoid (verify only)' generates no rows; "
                                              "give --eval-data"),
    ]:
        assert main(["compare", str(path), str(path), "--output", str(out), "--quiet", "--task", task]) == 2
        assert capsys.readouterr().err == message + "\n"
        assert not out.exists()
