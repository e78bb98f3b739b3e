"""configs/grpo.yaml and configs/ppo.yaml run as shipped, with only the model swapped."""

import json
from pathlib import Path

import pytest

from grpo.cli import main

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name, models", [("grpo", 3), ("ppo", 4)])
def test_shipped_config_runs(capsys, tiny_model, tmp_path, name, models):
    code = main(
        [
            "train",
            str(ROOT / "configs" / f"{name}.yaml"),
            "--quiet",
            "--set",
            f"model={tiny_model}",
            "--set",
            f"data.path={ROOT / 'examples' / 'arithmetic.jsonl'}",
            "--set",
            f"output_dir={tmp_path / name}",
            "--set",
            "train.steps=2",
            "--set",
            "rollout.max_new_tokens=8",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["models"] == models
    assert {"reward/math_answer", "reward/r1_format"} <= set(metrics[-1])
