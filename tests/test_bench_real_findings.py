"""benchmarks/real_findings.py (issue 40), cut down to a tiny chat model: every stage runs (the
format warm-up, the base's evaluation with its truncated share, GRPO over two seeds, PPO at
equal prompts and at equal generated tokens, every final model's evaluation) and the table,
the plot and summary.json hold what the report reads: curves per arm, the seeds' range, and
per run its peak memory, models held and generated tokens."""

import json

import torch

from benchmarks import real_findings
from grpo.tasks.tiny import tiny_llama
from tests.train.test_sft_data import chat_tokenizer


def test_the_command_runs_every_stage_and_reports_what_the_issue_asks(tmp_path, capsys):
    tokenizer = chat_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tiny_llama(tokenizer, hidden_size=32, layers=1, heads=2, max_positions=128).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = [
        "--model", str(tmp_path / "tiny"), "--out", str(out), "--seeds", "2", "--steps", "2", "--n", "4",
        "--held-out", "3", "--max-new-tokens", "6", "--train-max-new-tokens", "6", "--group-size", "2",
        "--prompts-per-step", "2", "--warmup-format", "--warmup-steps", "2", "--parallel", "2", "--quiet",
    ]  # fmt: skip
    assert real_findings.main(argv) == 0
    printed = capsys.readouterr().out
    assert "cut at the budget:" in printed and "pass@4: base" in printed and "maj@4: base" in printed

    summary = json.loads((out / "summary.json").read_text())
    arms = summary["arms"]
    assert list(arms) == ["base", "grpo", "ppo_equal_prompts", "ppo_equal_tokens"]
    for name, arm in arms.items():
        assert list(arm["pass@k"]) == ["1", "2", "4"] and list(arm["maj@k"]) == ["1", "2", "4"], name
        assert 0.0 <= arm["truncated"] <= 1.0
    assert len(arms["grpo"]["per_seed"]) == 2 and "pass@k_range" in arms["grpo"]
    grpo, ppo, ppo_tokens = (arms[k]["cost"] for k in ("grpo", "ppo_equal_prompts", "ppo_equal_tokens"))
    assert ppo["models"] == grpo["models"] + 1  # the value model
    assert min(grpo["peak_memory_mb"], ppo["peak_memory_mb"]) > 0
    # Equal generated tokens: G times the prompts of a step, one sample each (6 tokens at most a sample).
    assert ppo_tokens["generated_tokens"] > ppo["generated_tokens"]
    assert summary["settings"]["held_out_questions"] == 3 and set(summary["stage_time_s"]) == {
        "format warm-up",
        "base evaluation",
        "training",
        "RL evaluations",
    }
    report = (out / "report.md").read_text()
    assert "| grpo |" in report and "| ppo_equal_tokens |" in report and "fig7.png" in report
    assert (out / "fig7.png").stat().st_size > 10_000
    assert (out / "warm" / "model.safetensors").exists()  # RL started from the format warm-up
    assert real_findings.main(argv) == 2  # an earlier output is not replaced without --overwrite
