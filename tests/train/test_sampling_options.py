"""rollout.min_p and rollout.repetition_penalty reach the sampler, and every pass of the step
scores the penalised distribution the sampler drew from (README, "Sampling")."""

import pytest

import grpo
from grpo.config import config_from_dict
from grpo.rollout import Sampler
from grpo.rollout.decoders import HFDecoder
from grpo.tasks.tiny import char_tokenizer


def test_the_config_s_sampling_options_reach_both_decoding_loops(make_config):
    rollout = config_from_dict(make_config(rollout={"min_p": 0.05, "repetition_penalty": 1.3})).rollout
    sampler = Sampler.from_config(char_tokenizer("ab"), rollout, prompt_column="prompt")
    assert (sampler.params.min_p, sampler.params.repetition_penalty) == (0.05, 1.3)  # the fast loop
    generate = HFDecoder(sampler.params).config
    assert (generate.min_p, generate.repetition_penalty) == (0.05, 1.3)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_every_pass_scores_the_penalised_distribution(make_config, algorithm):
    """On the first step the policy, the old policy and the reference are one model: if the
    reference's pass, the old policy's and the update all score the same penalised
    distribution, the KL is 0 and the first epoch's ratio is exactly 1. A pass that left the
    penalty out would see a KL and ratios far from 1 (penalty 2 halves repeated logits)."""
    config = make_config(
        algorithm,
        rollout={"repetition_penalty": 2.0},
        train={"steps": 1, "epochs": 2, "lr": 1e-9},  # the second epoch's ratio stays ~1 too
        loss={"clip_low": 0.01, "clip_high": 0.01},
    )
    metrics = grpo.train(config, progress=False).metrics[0]
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["clip_fraction"] == 0.0
