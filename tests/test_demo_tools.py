"""`grpo demo --tools`: a minimal budget runs every stage and its report has the numbers; the
findings and the report read what was measured."""

import json

import pytest
import yaml

from grpo.demo.tool_use import QUICK, ToolsDemoConfig, _over_seeds, findings, quick, tools_demo, write_report
from grpo.errors import UserError


def measured(p1, maj, right, none, wrong=0.0):
    return {
        "pass@k": {"1": p1, "8": maj},
        "maj@k": {"1": p1, "8": maj},
        "pass@k_ci": {"1": [p1 - 0.05, p1 + 0.05], "8": [maj - 0.05, maj + 0.05]},
        "maj@k_ci": {"1": [p1 - 0.05, p1 + 0.05], "8": [maj - 0.05, maj + 0.05]},
        "tool_use": {"right": right, "wrong": wrong, "none": none},
        "no_answer": 0.0,
        "per_prompt": [{"pass@k": {"1": p1, "8": maj}, "maj@k": {"1": p1, "8": maj}}],
    }


def summary(grpo_p1s=(0.65, 0.72, 0.67), without=0.0):
    base = measured(0.345, 0.8, 0.43, 0.54)
    seeds = [measured(p1, 0.82, 0.87, 0.05) for p1 in grpo_p1s]
    return {
        "config": {**ToolsDemoConfig().__dict__, "ks": [1, 8]},
        "host": {"cpu_model": "a CPU", "cpu_flags": ["avx2"], "cpus": 2},
        "time_s": 120.0,
        "base": {"tools": base, "no_tools": measured(0.005, 0.005, 0.0, 1.0)},
        "grpo": {"tools": _over_seeds(seeds), "no_tools": _over_seeds([measured(without, 0.0, 0.0, 1.0)] * 3)},
        "training": {
            "seed-0": {"time_s": 40.0, "reward": [0.3] * 5 + [0.7] * 5, "calls_per_rollout": [0.4] * 9 + [1.0]}
        },
    }


def test_the_seeds_are_averaged_and_the_findings_read_the_numbers():
    s = summary()
    entry = s["grpo"]["tools"]
    assert entry["pass@k"]["1"] == pytest.approx((0.65 + 0.72 + 0.67) / 3)
    assert entry["pass@k_range"]["1"] == [0.65, 0.72] and entry["tool_use"]["right"] == pytest.approx(0.87)
    f = findings(s)
    assert f["accuracy_up_with_tool_every_seed"] and f["right_calls_up_every_seed"]
    assert f["pass@1_gain_with_tool"] == pytest.approx(0.68 - 0.345)
    assert f["pass@1_gain_without_tool"] == pytest.approx(-0.005)
    # One seed below the base: not "in every seed".
    assert not findings(summary(grpo_p1s=(0.65, 0.30, 0.67)))["accuracy_up_with_tool_every_seed"]


@pytest.mark.parametrize(
    "without, says",
    [(0.0, "What RL found is the tool, not multiplication in the head."), (0.2, "points.\n")],
)
def test_the_report_has_the_table_and_says_whose_gain_it_is(tmp_path, without, says):
    s = summary(without=without)
    s["findings"] = findings(s)
    write_report(tmp_path / "report.md", s)
    report = (tmp_path / "report.md").read_text()
    assert "| base (SFT) | yes | 34.5% [29.5-39.5] | 80.0% [75.0-85.0] | 43.0% | 0.0% | 54.0% |  |" in report
    assert (
        "| GRPO | yes | 68.0% [68.0-68.0] | 82.0% [82.0-82.0] | 87.0% | 0.0% | 5.0% | 65.0%, 72.0%, 67.0% |" in report
    )
    assert "GRPO moved pass@1 by +33.5 points (above the base in every seed)" in report
    assert says in report
    if without:
        assert "What RL found is the tool" not in report
    assert "mean reward 0.30 -> 0.70, tool calls per rollout 0.40 -> 1.00" in report


@pytest.mark.slow
def test_a_minimal_demo_runs_every_stage_and_reports_its_numbers(tmp_path):
    out = tmp_path / "demo"
    config = quick(ToolsDemoConfig())
    saved = tools_demo(out, config, progress=False)
    assert saved == json.loads((out / "summary.json").read_text())
    for model in ("base", "grpo"):
        for offered in ("tools", "no_tools"):
            entry = saved[model][offered]
            assert set(entry["pass@k"]) == {"1", "2", "4"} and set(entry["maj@k_ci"]) == {"1", "2", "4"}
            assert sum(entry["tool_use"].values()) == pytest.approx(1.0)
        assert saved[model]["no_tools"]["tool_use"]["none"] == 1.0  # no tool offered: no call runs
    assert [s["pass@k"] for s in saved["grpo"]["tools"]["per_seed"]] == [saved["grpo"]["tools"]["pass@k"]]
    assert len(saved["training"]["seed-0"]["reward"]) == QUICK["steps"]
    assert set(saved["findings"]) >= {"accuracy_up_with_tool_every_seed", "pass@1_gain_with_tool"}
    run = yaml.safe_load((out / "grpo" / "seed-0.yaml").read_text())
    assert run["rollout"]["tools"] == ["grpo.tasks.multiply:multiply"]
    assert run["rewards"] == [{"function": "grpo.tasks.multiply:correctness_reward", "weight": 1.0}]
    assert (out / "grpo" / "seed-0" / "final" / "config.json").exists()
    report = (out / "report.md").read_text()
    assert report.count("| GRPO |") == 2 and report.count("| base (SFT) |") == 2
    with pytest.raises(UserError, match="pass --overwrite"):
        tools_demo(out, config, progress=False)


def test_the_main_demos_flags_are_refused_with_tools(tmp_path, capsys):
    """The command's refusal (in this process: the refusal, not the process, is under test)."""
    from grpo.cli import main

    assert main(["demo", "--tools", "--full", "--output", str(tmp_path / "d")]) != 0
    assert "grpo: error: demo --tools: --full is the main demo's flag" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
