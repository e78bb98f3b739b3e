"""loss.engine_correction in the step, and the mismatch metrics of a real run.

On the fixed rollout of test_assembled_step (its engine and plain GRPO), with the sampler's
log-probs planted off the trainer's: token_tis is the plain step with each token's clipped
surrogate (not its KL term) weighed by min(pi_old / pi_sampler, C); sequence_mask is the plain
step without the out-of-bounds sequences; none is the step of a rollout without sampler
log-probs, to the bit. Then real `grpo.train` runs: with the fast loop (the trainer's own
numbers) the metrics say no mismatch; with the sampler planted at temperature 1.1 over the
trainer's 1.0 they show it, and they are the hand-computed ones on the batch the update
trained on (micro-batches, trimming, groups dropped, truncated rows masked).
"""

import dataclasses
import json
import math

import pytest
import torch

import grpo
from grpo.config import config_from_dict
from grpo.rewards import WeightedReward
from grpo.rollout.params import SamplingParams
from grpo.train.loop import build_engine
from grpo.train.layouts import policy_logprobs
from grpo.train.step import collect, learn
from tests.helpers import run_generator, sample
from tests.train.rewards_for_tests import sevens
from tests.train.test_assembled_step import (
    BETA,
    COMPLETIONS,
    GRPO_PROMPTS,
    REWARDS,
    assert_same_step,
    clipped_surrogate,
    engine_with_fixed_rollout,
    plain_logprobs,
    plain_updates,
    run_engine,
)

CAP = 2.0
METRICS = ("rollout/mismatch_kl", "rollout/mismatch_ratio_max", "rollout/frac_corrected")


def planted_engine(make_config, mode, epochs=1, shift=None):
    """The fixed-rollout engine with loss.engine_correction `mode` and the sampler's log-probs
    planted at the (nudged) policy's minus `shift` (N, T): log r = shift."""
    e, rollout, reference, models = engine_with_fixed_rollout(make_config, "grpo", GRPO_PROMPTS, 3, epochs)
    e.loss = dataclasses.replace(e.loss, engine_correction=mode, engine_correction_cap=CAP)
    if shift is not None:
        with torch.no_grad():
            rollout.sampled_logprobs = (plain_logprobs(models[0], rollout) - shift) * rollout.completion_mask
    return e, rollout, reference, models


def token_shift(rollout):
    """log r per token, from -1.2 to 1.2: some ratios above C = 2 (log 2 = 0.69), some below 1."""
    generator = torch.Generator().manual_seed(3)
    return (torch.rand(rollout.completion_mask.shape, generator=generator) * 2.4 - 1.2) * rollout.completion_mask


def plain_weighted_grpo(policy, reference, b, weight_of, epochs):
    """DeepSeekMath eq. 3 with per-token weights: weight_of(old_logprobs) -> (pg weights (N, T),
    whole-loss weights (N, 1)), both computed here from the plain old log-probs."""
    mask = b.completion_mask
    groups = torch.tensor([REWARDS[c] for c in COMPLETIONS]).view(-1, 3)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    with torch.no_grad():
        ref_logprobs, old_logprobs = plain_logprobs(reference, b), plain_logprobs(policy, b)
    pg_weights, kept = weight_of(old_logprobs)

    def loss():
        logprobs = plain_logprobs(policy, b)
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = (clipped_surrogate(logprobs, old_logprobs, advantages) * pg_weights + BETA * kl) * kept
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()

    return plain_updates([policy], loss, epochs)


@pytest.mark.parametrize("epochs", [1, 2])  # 2: the weights come from the old-policy pass, and stay
def test_token_tis_weighs_the_policy_gradient_term_and_not_the_kl(make_config, epochs):
    e, rollout, reference, models = planted_engine(make_config, "token_tis", epochs)
    shift = token_shift(rollout)
    with torch.no_grad():
        rollout.sampled_logprobs = (plain_logprobs(models[0], rollout) - shift) * rollout.completion_mask
    metrics, seen = run_engine(e, rollout)

    def weight_of(old_logprobs):
        sampled = rollout.sampled_logprobs
        return torch.exp(old_logprobs - sampled).clamp(max=CAP), 1.0

    plain = plain_weighted_grpo(models[0], reference, rollout, weight_of, epochs)
    assert_same_step(e, metrics, seen, plain, models)
    mask = rollout.completion_mask.bool()
    capped = (shift > math.log(CAP)) & mask
    assert 0 < int(capped.sum()) < int(mask.sum())
    assert metrics["rollout/frac_corrected"] == pytest.approx(float(capped.sum() / mask.sum()))
    assert metrics["rollout/mismatch_ratio_max"] == pytest.approx(float(shift[mask].max().exp()), rel=1e-4)
    r = shift[mask].exp()
    assert metrics["rollout/mismatch_kl"] == pytest.approx(float((r - 1 - r.log()).mean()), rel=1e-4)


def test_sequence_mask_takes_out_of_bounds_sequences_out_of_the_whole_loss(make_config):
    e, rollout, reference, models = planted_engine(make_config, "sequence_mask")
    mask = rollout.completion_mask
    per_token = torch.tensor([0.05, -0.05, 0.3, 0.05, -0.6, 0.0]).unsqueeze(1)  # log r of each token, per row
    shift = per_token * mask  # log R of rows 2 and 4: 3 x 0.3 and 5 x -0.6, out of [-log 2, log 2]
    log_sequence_ratio = shift.sum(1)
    out = log_sequence_ratio.abs() > math.log(CAP)
    assert 0 < int(out.sum()) < len(out), log_sequence_ratio
    with torch.no_grad():
        rollout.sampled_logprobs = (plain_logprobs(models[0], rollout) - shift) * mask
    metrics, seen = run_engine(e, rollout)
    kept = (~out).float().unsqueeze(1)
    plain = plain_weighted_grpo(models[0], reference, rollout, lambda old: (kept, kept), 1)
    assert_same_step(e, metrics, seen, plain, models)
    assert metrics["rollout/frac_corrected"] == pytest.approx(float(mask[out].sum() / mask.sum()))


def test_none_is_the_step_without_sampler_log_probs_to_the_bit(make_config):
    """With loss.engine_correction: none the planted log-probs change nothing: the same
    gradients and weights, bit for bit, as the same rollout without them (the step as it was
    before the correction existed). They are still measured."""
    runs = []
    for shift in (None, "planted"):
        e, rollout, _, _ = planted_engine(make_config, "none")
        if shift is not None:
            with torch.no_grad():
                rollout.sampled_logprobs = (
                    plain_logprobs(e.policy, rollout) - token_shift(rollout)
                ) * rollout.completion_mask
        metrics, seen = run_engine(e, rollout)
        runs.append((metrics, seen, e.policy.state_dict()))
    (plain, plain_seen, plain_weights), (measured, seen, weights) = runs
    assert all(plain[key] is None for key in METRICS)
    assert measured["rollout/mismatch_kl"] > 0.1 and measured["rollout/frac_corrected"] == 0.0
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert measured[key] == plain[key], key
    ((grads,),), ((plain_grads,),) = seen, plain_seen  # one optimizer step, one model
    assert all(torch.equal(grads[name], plain_grads[name]) for name in plain_grads)
    assert all(torch.equal(weights[name], plain_weights[name]) for name in plain_weights)


# ---- real runs --------------------------------------------------------------------------------


@pytest.fixture
def sampler_temperature(monkeypatch):
    """Plant a mismatch: the run's sampler draws at `factor` x rollout.temperature while the
    loss scores at rollout.temperature (the sampler's log-probs are of what it drew from)."""
    original = SamplingParams.from_config.__func__

    def plant(factor):
        def from_config(cls, rollout, tokenizer):
            params = original(cls, rollout, tokenizer)
            return dataclasses.replace(params, temperature=rollout.temperature * factor)

        monkeypatch.setattr(SamplingParams, "from_config", classmethod(from_config))

    return plant


def sevens_but_not_for_a(prompts, completions, **columns):
    """`sevens`, and 0 for every completion of prompt "a": a group without spread."""
    return [0.0 if p == "a" else r for p, r in zip(prompts, sevens(prompts, completions))]


def untruncated(make_config, **loss):
    """The tiny run with nothing truncating its sampling (min_new_tokens 0; EOS ends rows)."""
    return make_config(
        rollout={"min_new_tokens": 0, "max_new_tokens": 8},
        train={"steps": 2, "lr": 1e-3},
        loss={"beta": 0.04, **loss},
    )


def test_the_fast_loop_shows_no_mismatch(make_config, tmp_path):
    result = grpo.train(untruncated(make_config), progress=False)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "engine_correction: token_tis" in saved  # the default where nothing truncates
    for m in result.metrics:
        assert 0 <= m["rollout/mismatch_kl"] < 1e-8
        assert m["rollout/mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert m["rollout/frac_corrected"] == 0.0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(set(METRICS) <= set(line) for line in lines)


def test_a_planted_temperature_mismatch_shows_in_the_metrics(make_config, sampler_temperature):
    sampler_temperature(1.1)
    result = grpo.train(untruncated(make_config, engine_correction_cap=1.02), progress=False)
    for m in result.metrics:
        assert m["rollout/mismatch_kl"] > 2e-5  # ~1e-4 on the tiny model (nearly uniform)
        assert m["rollout/mismatch_ratio_max"] > 1.02
        assert 0 < m["rollout/frac_corrected"] < 0.5


@pytest.mark.parametrize("mode", ["token_tis", "sequence_mask"])
def test_the_metrics_are_those_of_the_rows_the_update_trained_on(make_config, sampler_temperature, mode):
    """Micro-batches of 3 ordered by length, each trimmed to its longest completion, groups
    without spread dropped, truncated rows out of the loss: every row's sampler log-probs
    follow it. The metrics equal the ones computed here on the whole batch at once."""
    sampler_temperature(1.1)
    c = config_from_dict(
        make_config(
            rollout={"min_new_tokens": 0, "max_new_tokens": 8},
            train={"steps": 1, "lr": 1e-3, "micro_batch_size": 3, "length_grouping": True},
            loss={
                "beta": 0.04,
                "engine_correction": mode,
                "engine_correction_cap": 1.01,  # some tokens above, some sequences out
                "drop_zero_std_groups": True,
                "mask_truncated_completions": True,
            },
        )
    )
    rewards = [WeightedReward(name="sevens", fn=sevens_but_not_for_a, weight=1.0)]
    e = build_engine(c, rewards)
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in ["a", "b", "c", "ab"]]
    collected = collect(e, sample(e, run_generator(c, e), rows))
    batch = collected.batch
    lengths = batch.completion_lengths
    assert len(batch) < len(collected.sampled)  # the group of "a" dropped
    assert lengths.min() < lengths.max()  # rows of different lengths: trimming cuts
    assert bool((batch.loss_mask.sum(1) < lengths).any())  # a truncated row out of the loss
    with torch.no_grad():
        old = policy_logprobs(e.policy, batch, 1.0, 1.0)  # (N, T): the weights that sampled
    mask = batch.loss_mask.bool()
    log_r = (old - batch.sampled_logprobs)[mask]
    r = log_r.exp()
    if mode == "token_tis":
        changed = float((r > 1.01).float().mean())
    else:
        out = ((old - batch.sampled_logprobs) * batch.loss_mask).sum(1).abs() > math.log(1.01)
        changed = float(batch.loss_mask[out].sum() / batch.loss_mask.sum())
    metrics = learn(e, collected)
    assert metrics["rollout/mismatch_kl"] == pytest.approx(float((r - 1 - log_r).mean()), rel=1e-3)
    assert metrics["rollout/mismatch_ratio_max"] == pytest.approx(float(r.max()), rel=1e-5)
    assert metrics["rollout/frac_corrected"] == pytest.approx(changed, abs=1e-6)
    assert 0 < changed < 1


@pytest.mark.learning
def test_grpo_learns_with_a_planted_mismatch_corrected(make_config, sampler_temperature):
    """The sampler at 1.1 x the loss's temperature, the default correction (token_tis: nothing
    truncates), EOS ending rows: the run still learns the sevens reward, with the mismatch
    measured at every step."""
    sampler_temperature(1.1)
    config = untruncated(make_config)
    config["train"].update(steps=40, sample_every=10)
    result = grpo.train(config, progress=False)
    rewards = [m["reward/mean"] for m in result.metrics]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, [round(r, 3) for r in rewards]
    assert all(m["rollout/mismatch_kl"] > 0 for m in result.metrics)
