"""A run killed at any point and resumed gives the metrics of a run never interrupted."""

import pytest
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

pytestmark = pytest.mark.resume

# What a step computes; times and memory are measurements, not results.
DETERMINISTIC = [
    "step",
    "iteration",
    "reward/mean",
    "reward/std",
    "loss",
    "kl",
    "entropy",
    "grad_norm",
    "tokens/completion",
    "completion_length/mean",
    "frac_zero_std_groups",
    "lr",
]


def grpo_train(config_path, *args, env=None):
    command = [str(Path(sys.executable).parent / "grpo"), "train", str(config_path), "--quiet", *args]
    return subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=Path(__file__).parents[2]
    )


def grpo_train_here(config_path, *args) -> int:
    """`grpo train` in this process (the CLI's own entry, as tests/train/test_faults.py runs it):
    the runs that are not killed need no interpreter of their own."""
    from tests.train.test_faults import train

    return train(config_path, *args)[0]


def results(output_dir, keys=DETERMINISTIC):
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in keys} for line in lines]


FAILS_IN_STEP_3 = [{"function": "tests.train.rewards_for_tests:sevens_then_raise"}]  # with GRPO_TEST_RAISE_AT=3


def straight_and_resumed(config, monkeypatch) -> None:
    """`config(name)` (a config whose rewards are FAILS_IN_STEP_3, output_dir named by `name`)
    run straight through as "straight", and as "resumed": stopped by its reward failing in
    step 3 (the checkpoint of step 2 saved), then resumed to its end."""
    import grpo
    from grpo.errors import UserError
    from tests.train import rewards_for_tests

    rewards_for_tests._calls["n"] = 0
    grpo.train(config("straight"), progress=False)
    monkeypatch.setenv("GRPO_TEST_RAISE_AT", "3")
    rewards_for_tests._calls["n"] = 0
    with pytest.raises(UserError, match="checkpoint of step 2 saved"):
        grpo.train(config("resumed"), progress=False)
    monkeypatch.delenv("GRPO_TEST_RAISE_AT")
    grpo.train(config("resumed"), resume=True, progress=False)


def test_killed_and_resumed_run_matches_an_uninterrupted_one(make_config, tmp_path):
    # 10 steps in 2 iterations (the reference is reset at step 6), checkpoints at 3 and 6.
    # The process is SIGKILLed inside step 8, after step 7 was logged: the resumed run must
    # restore the reset reference, drop step 7's line and redo it identically.
    settings = dict(
        train={"steps": 10, "iterations": 2, "checkpoint_every": 3, "lr": 1e-3},
        rewards=[{"function": "tests.train.rewards_for_tests:sevens_then_die"}],
    )
    for name in ("straight", "killed"):
        config = make_config(**settings)
        config["output_dir"] = str(tmp_path / name)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))

    assert grpo_train_here(tmp_path / "straight.yaml") == 0

    killed = grpo_train(tmp_path / "killed.yaml", env={"GRPO_TEST_DIE_AT": "8"})
    assert killed.returncode == -signal.SIGKILL
    assert [m["step"] for m in results(tmp_path / "killed")] == list(range(1, 8))

    assert grpo_train_here(tmp_path / "killed.yaml", "--resume") == 0
    assert results(tmp_path / "killed") == results(tmp_path / "straight")
    assert [m["iteration"] for m in results(tmp_path / "killed")] == [1] * 5 + [2] * 5


def test_resume_restores_an_iteratively_trained_reward_model(make_config, sevens_rm, tmp_path):
    # 3 iterations of 2 steps: the reward model is updated before steps 3 and 5. Checkpoints
    # at 4; killed inside step 6. The resumed run needs the updated reward model, its
    # comparison history and its random state from the checkpoint.
    rm_dir, history = sevens_rm
    settings = dict(
        rewards=[{"model": rm_dir}, {"function": "tests.train.rewards_for_tests:sevens_then_die", "weight": 0.0}],
        train={"steps": 6, "iterations": 3, "checkpoint_every": 4, "lr": 1e-3},
        reward_model_update={
            "verifier": "tests.train.rewards_for_tests:sevens",
            "data": history,
            "prompts": 4,
            "samples_per_prompt": 4,
            "lr": 1e-3,
        },
    )
    for name in ("straight", "killed"):
        config = make_config(**settings)
        config["output_dir"] = str(tmp_path / name)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
    assert grpo_train_here(tmp_path / "straight.yaml") == 0
    assert grpo_train(tmp_path / "killed.yaml", env={"GRPO_TEST_DIE_AT": "6"}).returncode == -signal.SIGKILL
    assert grpo_train_here(tmp_path / "killed.yaml", "--resume") == 0
    assert results(tmp_path / "killed") == results(tmp_path / "straight")
    straight, killed = (
        [json.loads(line) for line in (tmp_path / run / "reward_model_updates.jsonl").read_text().splitlines()]
        for run in ("straight", "killed")
    )
    assert len(straight) == 2 and killed == straight
