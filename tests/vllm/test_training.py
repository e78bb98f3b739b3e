"""Training with `rollout.sampler: vllm`: GRPO and PPO learn a rule reward, with one engine for
the whole run, shut down as it ends; a resumed run continues as the straight run did."""

import json

import pytest

import grpo
from tests.train.test_learning import gain
from tests.vllm.models import WORST_GAP, save

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny tied Qwen2 (head_dim 64), initialised as transformers does (near uniform)."""
    return str(save("qwen2", tmp_path_factory.mktemp("qwen2"), std=0.02))


def vllm_config(make_config, model, algorithm="grpo", **train):
    config = make_config(algorithm, train={"steps": 30, "lr": 1e-3, "sample_every": 0, **train})
    config["model"] = model
    config["rollout"].update(sampler="vllm", vllm={"max_num_seqs": 32})
    return config


@pytest.mark.learning
def test_grpo_with_vllm_learns_the_sevens_reward_on_one_engine(make_config, qwen2, built_engines):
    result = grpo.train(vllm_config(make_config, qwen2), progress=False)
    rewards = [round(m["reward/mean"], 3) for m in result.metrics]
    assert gain(result.metrics) >= 0.25, rewards
    (engine,) = built_engines  # one engine for 30 steps, the run's own
    assert engine.closed  # shut down by the run's generator as the run ended
    assert engine.holds[1] == 29  # synced after every update: the last sample's policy had taken 29 steps
    # The mismatch metrics see the engine's log-probs. Its kernels agree with the trainer's (fp32,
    # tests/vllm/test_engine.py); what is left is min_new_tokens (8 here) holding EOS back: the
    # engine gives each token's log-prob without EOS's share, so the trainer's is never above it.
    for m in result.metrics:
        assert 0 < m["rollout/mismatch_kl"] < 1e-3 and m["rollout/mismatch_ratio_max"] <= 1 + WORST_GAP, m


@pytest.mark.learning
def test_ppo_with_vllm_learns_the_sevens_reward(make_config, qwen2):
    result = grpo.train(vllm_config(make_config, qwen2, "ppo"), progress=False)
    assert gain(result.metrics) >= 0.1, [round(m["reward/mean"], 3) for m in result.metrics]


@pytest.mark.resume
def test_a_resumed_run_continues_as_the_straight_run(make_config, qwen2, tmp_path):
    """Checkpoint at step 3, stop at 4, resume to 6: the same metrics as 6 steps straight.
    The resumed run builds its own engine (as every run does), given the checkpoint's
    weights at its first sync; its seeds come from the sampler's own stream for each step (rollout.seed_per_prompt
    off), so the same tokens are drawn."""
    straight = vllm_config(make_config, qwen2, steps=6, checkpoint_every=3)
    straight["output_dir"] = str(tmp_path / "straight")
    expected = grpo.train(straight, progress=False).metrics
    stopped = vllm_config(make_config, qwen2, steps=6, checkpoint_every=3)
    stopped["output_dir"] = str(tmp_path / "resumed")
    grpo.train(stopped, overrides=["train.steps=4"], progress=False)
    resumed = grpo.train(stopped, resume=True, progress=False).metrics
    keys = ("reward/mean", "kl", "loss", "tokens/completion", "completion_length/mean")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    for a, b in zip(expected, resumed):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a["step"], a, b)
    samples = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    assert len(samples) == 6 and json.loads(samples[-1])["step"] == 6
