"""A run killed at any point and resumed gives the metrics of a run never interrupted."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

# What a step computes; times and memory are measurements, not results.
DETERMINISTIC = ["step", "iteration", "reward/mean", "reward/std", "loss", "kl", "entropy", "grad_norm",
                 "tokens/completion", "completion_length/mean", "frac_zero_std_groups", "lr"]


def grpo_train(config_path, *args, env=None):
    command = [str(Path(sys.executable).parent / "grpo"), "train", str(config_path), "--quiet", *args]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=Path(__file__).parents[2])


def results(output_dir):
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in DETERMINISTIC} for line in lines]


def test_killed_and_resumed_run_matches_an_uninterrupted_one(make_config, tmp_path):
    # 10 steps in 2 iterations (the reference is reset at step 6), checkpoints at 3 and 6.
    # The process is SIGKILLed inside step 8, after step 7 was logged: the resumed run must
    # restore the reset reference, drop step 7's line and redo it identically.
    settings = dict(train={"steps": 10, "iterations": 2, "checkpoint_every": 3, "lr": 1e-3},
                    rewards=[{"function": "tests.train.rewards_for_tests:sevens_then_die"}])
    for name in ("straight", "killed"):
        config = make_config(**settings)
        config["output_dir"] = str(tmp_path / name)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))

    straight = grpo_train(tmp_path / "straight.yaml")
    assert straight.returncode == 0, straight.stderr

    killed = grpo_train(tmp_path / "killed.yaml", env={"GRPO_TEST_DIE_AT": "8"})
    assert killed.returncode == -signal.SIGKILL
    assert [m["step"] for m in results(tmp_path / "killed")] == list(range(1, 8))

    resumed = grpo_train(tmp_path / "killed.yaml", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert results(tmp_path / "killed") == results(tmp_path / "straight")
    assert [m["iteration"] for m in results(tmp_path / "killed")] == [1] * 5 + [2] * 5
