"""A token that is there but is not the policy's action (a tool's output inside a completion).

Such a token is in `completion_mask` (attended to, counted in the completion's length, kept
by trimming) and not in `loss_mask`: no loss, count or statistic of the policy may read it.
One is planted in the middle of a completion and one at the end of another, and the step
is compared with versions where those tokens' contributions are removed by construction:
- at the end of a completion the token can be removed outright (causal attention: no other
  token sees it), so the step with it and the step without it must agree in every number
  but the lengths;
- in the middle, later tokens see it; the step must agree with a plain implementation that
  reads each completion's action tokens by their positions (never the planted one), with
  GAE running from one action token to the next.
The remaining consumers (trimming, lengths, truncation, the chunked head, process
supervision, the placeholder and the padding passes) are checked on their own.
"""

import dataclasses

import pytest
import torch

from grpo.algo import process_advantages
from grpo.infra.distributed import SingleProcess
from grpo.rewards import WeightedReward
from grpo.train.layouts import completion_logprobs
from grpo.train.seams import ProcessBaseline, Scored
from grpo.train.step import _placeholder, collect
from tests.helpers import BACKWARD, assert_close_scaled, assert_same_metrics
from tests.train.test_assembled_step import (
    BETA,
    CLIP,
    GRPO_PROMPTS,
    PPO_PROMPTS,
    clipped_surrogate,
    engine_with_fixed_rollout,
    plain_updates,
    plain_values,
    run_engine,
)

# The fixed rollout of the assembled step: "c1a2b" fills all T_LEN = 5 tokens (cut off), the
# others end in EOS. Its rewards, with the cut-off one's not 0 (it must land on an action).
COMPLETIONS = ["7", "3a7c", "b0", "77", "c1a2b", ""]
REWARDS = {"7": 1.0, "3a7c": 0.25, "b0": -0.5, "77": 2.0, "c1a2b": -1.0, "": 0.5}
MIDDLE = (1, 1)  # (row, column): the "a" of "3a7c", with tokens before and after it
END = (4, 4)  # the last token of "c1a2b", a longest completion: trimming must keep its column


def fixed_rewards(prompts, completions, **columns):
    return [REWARDS[c] for c in completions]


def planted_engine(make_config, algorithm, *, train=None, loss=None, end_token=True):
    """The assembled step's engine on its fixed rollout (two update epochs: the second
    update's ratios move off 1 and clip), with MIDDLE and END out of the loss mask; without
    `end_token`, END's token is not there at all (its completion one token shorter). Returns
    the engine, the rollout, the frozen reference and copies of the trained models."""
    prompts, group_size = (GRPO_PROMPTS, 3) if algorithm == "grpo" else (PPO_PROMPTS, 1)
    e, rollout, reference, models = engine_with_fixed_rollout(make_config, algorithm, prompts, group_size, epochs=2)
    e.rewards = [WeightedReward(name="fixed", fn=fixed_rewards, weight=1.0)]
    e.loss = dataclasses.replace(e.loss, **(loss or {}))
    if "chunked_head" in (train or {}):  # the head is what the engine decided (train.chunked_head asks for it)
        e.decisions = dataclasses.replace(e.decisions, chunked_head=train["chunked_head"])
    rollout.loss_mask[MIDDLE] = rollout.loss_mask[END] = 0.0
    if not end_token:
        p_len = rollout.input_ids.shape[1] - rollout.completion_mask.shape[1]
        rollout.completion_mask[END] = 0.0
        rollout.attention_mask[END[0], p_len + END[1]] = 0
    return e, rollout, reference, models


# The numbers of the policy's update and of its statistics: none may see a loss-masked token.
POLICY_METRICS = ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "value_loss", "value/mean", "tokens/trained")

VARIANTS = {
    # GRPO as shipped, the chunked head (which computes the loss's tokens only).
    "grpo": ("grpo", {}, {}),
    # Every token weighs the same (num_tokens counts), GSPO's sequence ratio (a row's mean
    # log-ratio over its actions), the plain head (log-probs and entropy at every token).
    "grpo-token-mean-sequence-plain-head": (
        "grpo",
        {"chunked_head": False},
        {"aggregation": "token-mean", "ratio_level": "sequence"},
    ),
    # PPO: critic, GAE and whitening, the KL in the per-token reward, the score at the last action.
    "ppo": ("ppo", {}, {}),
    "ppo-plain-head": ("ppo", {"chunked_head": False}, {}),
}


def variant(make_config, name, end_token=True):
    algorithm, train, loss = VARIANTS[name]
    return planted_engine(make_config, algorithm, train=train, loss=loss, end_token=end_token)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_loss_masked_last_token_changes_nothing_but_the_lengths(make_config, name):
    results = []
    for end_token in (True, False):
        e, rollout, _, _ = variant(make_config, name, end_token)
        results.append(run_engine(e, rollout))
    (with_it, seen_with), (without, seen_without) = results
    assert_same_metrics(with_it, without, [key for key in POLICY_METRICS if key in with_it])
    assert len(seen_with) == len(seen_without) == 2
    assert_close_scaled(seen_with, seen_without, BACKWARD)
    # The token is there: it counts in the lengths (and not in the tokens trained on, above).
    assert with_it["tokens/completion"] == without["tokens/completion"] + 1
    assert with_it["frac_truncated"] == without["frac_truncated"]  # its row is cut off either way


# ---- the plain versions, over each completion's action tokens by position --------------------


def actions(rollout):
    """Each row's action tokens: the columns its loss mask marks, in order."""
    return [row.nonzero().squeeze(1).tolist() for row in rollout.loss_mask]


def position_ids(b):
    return (b.attention_mask.cumsum(-1) - 1).clamp(min=0)


def plain_forward(model, b):
    """(N, T) log pi(o_t | q, o_<t) and the entropy of each position's distribution."""
    ids, t_len = b.completion_ids, b.completion_mask.shape[1]
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids(b)).logits
    logp = torch.log_softmax(logits[:, -t_len - 1 : -1].float(), -1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def clipped(ratio, advantages):
    """Whether the clip removed the token's gradient (ratio outside the bound the advantage pushes to)."""
    return ((ratio > 1 + CLIP) & (advantages > 0)) | ((ratio < 1 - CLIP) & (advantages < 0))


def policy_statistics(first, old, ref, kl, acts):
    """The first epoch's KL and entropy, means over every action token."""
    logprobs, entropy = first
    kls = torch.cat([kl(logprobs[i, pos], ref[i, pos]) for i, pos in enumerate(acts)])
    entropies = torch.cat([entropy[i, pos] for i, pos in enumerate(acts)])
    return float(kls.mean()), float(entropies.mean())


def k3(logprobs, ref_logprobs):
    return torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1


def k1(logprobs, ref_logprobs):
    return logprobs - ref_logprobs


def plain_grpo(policy, reference, b, rewards, aggregation, level):
    acts = actions(b)
    groups = rewards.view(-1, b.group_size)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    with torch.no_grad():
        ref, old = plain_forward(reference, b)[0], plain_forward(policy, b)[0]
    epochs, fractions = [], []

    def loss():
        logprobs, entropy = plain_forward(policy, b)
        epochs.append((logprobs.detach(), entropy.detach()))
        rows, clips = [], []
        for i, pos in enumerate(acts):
            log_ratio = logprobs[i, pos] - old[i, pos]  # (|o_i|,)
            if level == "sequence":  # GSPO: the row's mean log-ratio, for each of its tokens
                log_ratio = log_ratio.mean().expand(len(pos))
            ratio, a = torch.exp(log_ratio), advantages[i].expand(len(pos))
            surrogate = -torch.min(ratio * a, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * a)
            rows.append(surrogate + BETA * k3(logprobs[i, pos], ref[i, pos]))
            clips.append(clipped(ratio.detach(), a))
        fractions.append(float(torch.cat(clips).float().mean()))
        if aggregation == "token-mean":
            return torch.cat(rows).sum() / sum(map(len, acts))
        return torch.stack([r.mean() for r in rows]).mean()

    mean_loss, grads, grad_norm = plain_updates([policy], loss, 2)
    kl, entropy = policy_statistics(epochs[0], old, ref, k3, acts)
    metrics = dict(loss=mean_loss, grad_norm=grad_norm, kl=kl, entropy=entropy, clip_fraction=sum(fractions) / 2)
    return metrics, grads


def plain_gae(rewards, values, gamma=1.0, lam=0.95):
    """GAE over one row's action tokens (1-D, in order): the next value is the next action's."""
    advantages, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for k in reversed(range(len(rewards))):
        running = rewards[k] + gamma * next_value - values[k] + gamma * lam * running
        advantages[k], next_value = running, values[k]
    return torch.stack(advantages) if advantages else torch.zeros(0)


def plain_ppo(policy, critic, reference, b, scores):
    acts = actions(b)
    with torch.no_grad():
        ref, old = plain_forward(reference, b)[0], plain_forward(policy, b)[0]
        old_values = plain_values(critic, b)
        advantages, returns = [], []
        for i, pos in enumerate(acts):
            rewards = -BETA * (old[i, pos] - ref[i, pos])  # k1 per action token
            rewards[-1] += scores[i]  # the score at the last action
            adv = plain_gae(rewards, old_values[i, pos])
            advantages.append(adv)
            returns.append(adv + old_values[i, pos])
        every = torch.cat(advantages)
        advantages = [(a - every.mean()) / torch.sqrt(every.var() + 1e-8) for a in advantages]  # unbiased var
    epochs, fractions, value_losses = [], [], []

    def loss():
        logprobs, entropy = plain_forward(policy, b)
        epochs.append((logprobs.detach(), entropy.detach()))
        values = plain_values(critic, b)
        rows, clips, value_terms = [], [], []
        for i, pos in enumerate(acts):
            ratio = torch.exp(logprobs[i, pos] - old[i, pos])
            rows.append(clipped_surrogate(logprobs[i, pos], old[i, pos], advantages[i]).mean())
            clips.append(clipped(ratio.detach(), advantages[i]))
            v, v_old = values[i, pos], old_values[i, pos]
            v_clipped = v_old + torch.clamp(v - v_old, -CLIP, CLIP)
            value_terms.append(torch.max((v - returns[i]) ** 2, (v_clipped - returns[i]) ** 2))
        fractions.append(float(torch.cat(clips).float().mean()))
        value_loss = 0.5 * torch.cat(value_terms).mean()
        value_losses.append(float(value_loss.detach()))
        return torch.stack(rows).mean() + value_loss

    mean_loss, grads, grad_norm = plain_updates([policy, critic], loss, 2)
    kl, entropy = policy_statistics(epochs[0], old, ref, k1, acts)
    value_mean = float(torch.cat([old_values[i, pos] for i, pos in enumerate(acts)]).mean())
    metrics = dict(loss=mean_loss, grad_norm=grad_norm, kl=kl, entropy=entropy, clip_fraction=sum(fractions) / 2)
    metrics.update({"value_loss": sum(value_losses) / 2, "value/mean": value_mean})
    return metrics, grads


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_loss_masked_token_inside_a_completion_is_left_out_of_the_step(make_config, name):
    e, rollout, reference, models = variant(make_config, name)
    metrics, seen = run_engine(e, rollout)
    scores = torch.tensor([REWARDS[c] for c in COMPLETIONS])
    if e.loss.baseline == "group":
        want, grads = plain_grpo(models[0], reference, rollout, scores, e.loss.aggregation, e.loss.ratio_level)
    else:
        want, grads = plain_ppo(*models, reference, rollout, scores)
    assert_same_metrics(metrics, want)
    assert want["clip_fraction"] > 0  # the second update clips: the fraction's count matters
    assert_close_scaled(seen, grads, BACKWARD)
    # Counted where tokens are counted: all completion tokens in the lengths, actions in the loss.
    assert metrics["tokens/completion"] == int(rollout.completion_mask.sum())
    assert metrics["tokens/trained"] == int(rollout.completion_mask.sum()) - 2
    # "3a7c" ends in EOS (not cut off) though its loss mask has a hole; "c1a2b" is cut off.
    assert metrics["frac_truncated"] == pytest.approx(1 / 6)


# ---- the other consumers, one by one ----------------------------------------------------------


@pytest.fixture
def planted(make_config):
    """The GRPO engine and its planted rollout."""
    return planted_engine(make_config, "grpo")[:2]


def test_trimming_keeps_a_loss_masked_last_token_and_lengths_count_it(planted):
    _, rollout = planted
    part = rollout.select(torch.tensor([3, 4]), trim=True)  # "77" + EOS and "c1a2b", the longer
    assert part.completion_mask.shape[1] == 5  # END's column is kept
    assert part.loss_mask[1].tolist() == [1.0] * 4 + [0.0]
    assert rollout.completion_lengths.tolist() == [2, 5, 3, 3, 5, 1]  # each completion's tokens, EOS included


def test_the_truncation_check_reads_the_last_token_there(planted):
    e, rollout = planted
    e.loss = dataclasses.replace(e.loss, mask_truncated_completions=True)
    collected = collect(e, rollout)
    assert collected.truncated.tolist() == [False, False, False, False, True, False]  # "3a7c" ends in EOS
    # Out of the loss: every token of the cut-off completion; still there: all of them.
    assert torch.equal(collected.batch.completion_mask, rollout.completion_mask)
    want = rollout.loss_mask.clone()
    want[END[0]] = 0.0
    assert torch.equal(collected.batch.loss_mask, want)
    assert torch.equal(collected.sampled.loss_mask, rollout.loss_mask)  # what was sampled keeps its own


def test_the_chunked_head_gives_a_loss_masked_token_no_log_prob_and_no_gradient(planted):
    e, rollout = planted
    weights = torch.randn(rollout.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for chunked in (True, False):
        e.policy.zero_grad()
        logprobs, _ = completion_logprobs(e.policy, rollout, 1.0, chunked_head=chunked)
        if chunked:
            assert (logprobs[rollout.loss_mask == 0] == 0).all()  # never computed
            (logprobs * weights).sum().backward()  # every position weighted: the planted ones have no gradient
        else:
            assert (logprobs[MIDDLE] != 0) and (logprobs[END] != 0)
            (logprobs * weights * rollout.loss_mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in e.policy.named_parameters()})
    assert_close_scaled(grads[0], grads[1], BACKWARD)


def test_process_supervision_gives_a_loss_masked_token_no_advantage(planted):
    e, rollout = planted
    baseline = ProcessBaseline(3, 1e-4, e.tokenizer)
    # Two steps in "3a7c": one ending at the planted "a" (character 2), one at its end.
    steps = [[(1, 1.0)], [(2, 0.5), (4, 1.0)], [(2, 0.0)], [(2, 1.0)], [(5, 0.0)], [(0, 0.5)]]
    advantages = baseline(rollout, Scored(torch.zeros(6), steps), None).advantages  # (N, T)
    rewards, ends = baseline.step_tensors(steps, rollout)
    everywhere = process_advantages(rewards, ends, rollout.completion_mask, 3)
    assert advantages[MIDDLE] == 0 and advantages[END] == 0 and everywhere[MIDDLE] != 0
    torch.testing.assert_close(advantages, everywhere * rollout.loss_mask)


def test_a_placeholder_group_has_no_token_in_the_loss(planted):
    _, rollout = planted
    group, scored = _placeholder(rollout, None)
    assert len(group) == 3 and (group.loss_mask == 0).all() and torch.isnan(scored.scores).all()
    assert torch.equal(group.completion_mask, rollout.completion_mask[:3])  # its tokens are still there


class PaddedWorld(SingleProcess):
    """One process that plans one more pass per minibatch than it needs, as a process with
    fewer rows than another does: those passes must weigh nothing."""

    def max(self, x):
        return x + 1 if not x.is_floating_point() else x


def test_padding_passes_weigh_nothing(make_config):
    results = []
    for world in (SingleProcess(), PaddedWorld()):
        e, rollout, _, _ = planted_engine(make_config, "grpo")
        e.world = world
        results.append(run_engine(e, rollout))
    (plain, seen), (padded, seen_padded) = results
    assert_same_metrics(padded, plain, [key for key in POLICY_METRICS if key in plain])
    assert_close_scaled(seen_padded, seen, BACKWARD)
