"""End-to-end runs on a tiny model that must actually learn."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import grpo

pytestmark = pytest.mark.learning

STEP_KEYS = {
    "step",
    "reward/mean",
    "reward/std",
    "reward/tests.train.rewards_for_tests:sevens",
    "kl",
    "loss",
    "clip_fraction",
    "entropy",
    "tokens/completion",
    "completion_length/mean",
    "frac_zero_std_groups",
    "time/step",
    "time/generate",
    "time/update",
    "memory/peak_mb",
}


def gain(metrics, k=5):
    rewards = [m["reward/mean"] for m in metrics]
    return sum(rewards[-k:]) / k - sum(rewards[:k]) / k


def check_run_outputs(result, steps):
    out = Path(result.output_dir)
    assert [m["step"] for m in result.metrics] == list(range(1, steps + 1))
    for m in result.metrics:
        assert STEP_KEYS <= set(m), STEP_KEYS - set(m)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, steps + 1))
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == steps
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "reward"} <= set(samples[0])
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()


def test_grpo_learns_the_sevens_reward(make_config, tiny_model):
    result = grpo.train(make_config(train={"steps": 40, "lr": 1e-3, "sample_every": 10}), progress=False)
    check_run_outputs(result, 40)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
    assert result.models_held == 3  # policy, reference, reward
    summary = json.loads((result.output_dir / "summary.json").read_text())
    policy_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert summary["parameters"] == 2 * policy_parameters  # the policy and its frozen copy
    assert summary["generated_tokens"] == 40 * 32 * 8 and summary["steps"] == 40
    assert result.metrics[0]["kl"] == 0.0 and result.metrics[-1]["kl"] > 0  # the policy moved away from the reference
    assert all(m["clip_fraction"] == 0.0 for m in result.metrics)  # mu = 1: the ratio is exactly 1
    # final/ holds the trained weights, not the initial ones.
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    final = AutoModelForCausalLM.from_pretrained(result.final_dir).state_dict()
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


def test_grpo_learns_with_the_fast_draws_single_matrices_packed(make_config, monkeypatch):
    """The sampling's room (the gradients the update holds) spent on packed copies of the head,
    down and output projections at every step (`FastDecoder`; packed here whatever their size
    and whatever the sampling holds of its own): the run learns as with plain ones."""
    import grpo.rollout.fast as fast

    if not fast.forward.packs(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packed inner product")
    monkeypatch.setattr(fast.forward, "PACK_FROM", 0)
    monkeypatch.setattr(fast, "sampling_bytes", lambda *a: 0)  # the tiny model's cache outweighs its gradients
    packed, real = [], fast.pack_single_matrices
    monkeypatch.setattr(fast, "pack_single_matrices", lambda w, room: packed.append(real(w, room)) or packed[-1])
    result = grpo.train(make_config(train={"steps": 40, "lr": 1e-3, "sample_every": 0}), progress=False)
    assert packed == [["head", "down", "out"]] * 40  # once a version, every step
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]


def test_ppo_learns_the_sevens_reward(make_config):
    config = make_config("ppo", train={"steps": 40, "lr": 1e-3, "sample_every": 10})
    result = grpo.train(config, progress=False)
    check_run_outputs(result, 40)
    assert gain(result.metrics) >= 0.1, [round(m["reward/mean"], 3) for m in result.metrics]
    assert result.models_held == 4  # policy, reference, reward, value
    assert result.summary["parameters"] > 2 * sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(config["model"]).parameters()
    )
    assert {"value_loss", "value/mean"} <= set(result.metrics[-1])


def test_grpo_learns_with_bf16_autocast(make_config, tmp_path):
    """train.autocast: bfloat16 runs the forward passes in bf16 (the numbers change) and still learns."""
    config = make_config(
        output_dir=str(tmp_path / "bf16"), train={"steps": 40, "lr": 1e-3, "sample_every": 10, "autocast": "bfloat16"}
    )
    result = grpo.train(config, progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
    plain = grpo.train(make_config(output_dir=str(tmp_path / "fp32"), train={"steps": 1, "lr": 1e-3}), progress=False)
    ours, reference = result.metrics[0], plain.metrics[0]
    assert ours["grad_norm"] != reference["grad_norm"]  # bf16 really ran
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=0.05)  # and nothing far off
