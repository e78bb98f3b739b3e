"""The demo's report reads its numbers, and a small-budget demo runs every stage."""

import json

import pytest

from grpo.demo import DemoConfig, demo
from grpo.errors import UserError
from grpo.eval.report import write_report

KS = [1, 2, 4, 8, 16, 32, 64]


def curves(pass_at, maj_at):
    return {"pass@k": {str(k): v for k, v in zip(KS, pass_at)}, "maj@k": {str(k): v for k, v in zip(KS, maj_at)},
            "pass@k_ci": {}, "maj@k_ci": {}, "no_answer": 0.0}


def run(models, parameters, memory, tokens, pass_at, maj_at):
    return {**curves(pass_at, maj_at), "models": models, "parameters": parameters, "peak_memory_mb": memory,
            "time_s": 60.0, "generated_tokens": tokens, "steps": 100, "prompts": 800, "time_per_step_s": 0.5,
            "reward": [0.2, 0.5]}


def summary(grpo_pass_at_64):
    return {
        "config": {**DemoConfig().__dict__},
        "sft": {"parameters": 84544, "steps": 375},
        "time_s": 600.0,
        "base": curves([0.30, 0.45, 0.60, 0.75, 0.85, 0.92, 0.95], [0.30, 0.30, 0.40, 0.45, 0.50, 0.52, 0.53]),
        "grpo": run(3, 169088, 400.0, 160000, [0.50, 0.62, 0.73, 0.82, 0.88, 0.93, grpo_pass_at_64],
                    [0.50, 0.50, 0.58, 0.62, 0.64, 0.65, 0.66]),
        "ppo": run(4, 253700, 430.0, 20000, [0.40] * 7, [0.40] * 7),
    }


def test_report_states_what_moved_and_by_how_much(tmp_path):
    write_report(tmp_path / "report.md", summary(grpo_pass_at_64=0.96))
    text = (tmp_path / "report.md").read_text()
    assert "GRPO moved pass@1 from 30.0% to 50.0% (+20.0 points)" in text
    assert "maj@16 from 50.0% to 64.0% (+14.0 points)" in text
    assert "pass@64 barely moved: 95.0% → 96.0% (+1.0 points)" in text
    assert "This is DeepSeekMath's finding" in text
    assert "PPO held 4 models" in text and "its peak memory was 30 MB higher" in text
    assert "GRPO generated 8.0x as many tokens" in text
    assert "| GRPO | 3 | 169,088 | 400 |" in text


def test_report_says_so_when_pass_at_large_k_moved_as_much(tmp_path):
    data = summary(grpo_pass_at_64=0.95)
    data["grpo"]["pass@k"]["64"] = 0.20 + data["base"]["pass@k"]["64"] - 0.2 + 0.0  # unchanged
    data["grpo"]["pass@k"]["1"] = 0.31
    data["base"]["pass@k"]["64"] = 0.70
    write_report(tmp_path / "report.md", data)
    text = (tmp_path / "report.md").read_text()
    assert "pass@64 rose: 70.0% → 95.0% (+25.0 points)" in text
    assert "not the pattern DeepSeekMath reports" in text


def test_quick_demo_runs_every_stage(tmp_path):
    config = DemoConfig(sft_steps=300, eval_prompts=8, n=8, ks=[1, 2, 4, 8], train_prompts=64, steps=3,
                        prompts_per_step=4, group_size=4, rm_prompts=16, rm_samples=8)
    out = tmp_path / "demo"
    result = demo(out, config, progress=False)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["time_s"] == pytest.approx(result["time_s"])
    for name in ("base", "grpo", "ppo"):
        assert set(saved[name]["pass@k"]) == {"1", "2", "4", "8"} and set(saved[name]["maj@k"]) == {"1", "2", "4", "8"}
    assert saved["grpo"]["models"] == 3 and saved["ppo"]["models"] == 4
    assert saved["grpo"]["generated_tokens"] > saved["ppo"]["generated_tokens"]
    assert ("grpo-rm" in saved) != (saved["neural_rm_skipped"] is not None)
    for png in ("pass_maj_at_k.png", "rewards.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Result 2: GRPO trades memory for generation" in (out / "report.md").read_text()

    with pytest.raises(UserError, match="pass --overwrite"):
        demo(out, config, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier demo's output"):
        demo(tmp_path / "other", config, progress=False, overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
