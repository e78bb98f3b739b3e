"""The assembled step against the papers, written out in plain PyTorch.

On a fixed rollout (hand-built prompts and completions, fixed rewards), one `train_step` of
the engine must give the same loss, the same gradients and the same updated weights as a
plain implementation of
- GRPO, DeepSeekMath eq. 3: (r - mean) / (std + eps) over the group (unbiased std, eps 1e-4),
  the clipped ratio, + beta * k3 KL per token against the reference, 1/G sum_i 1/|o_i| sum_t;
- PPO, DeepSeekMath eq. 1-2: r_t = -beta * log(pi_old / pi_ref) per token plus the score at
  the last token, GAE (gamma 1, lambda 0.95) on the critic's values, whitened advantages
  (unbiased variance), the clipped ratio and the clipped value loss.
The plain versions use only torch and the Hugging Face models: their own log-softmax, masks,
advantages, KL and clipping, and their own AdamW and clip_grad_norm_ on copies of the
models. The policy is moved off the reference before the step (as after earlier steps), so
that the KL and its gradient are not 0; PPO's critic head is moved off 0 for the same reason.
"""

import copy

import pytest
import torch

from grpo.config import config_from_dict
from grpo.rewards import WeightedReward
from grpo.rollout import Rollout
from grpo.train.loop import build_engine
from grpo.train.step import train_step
from tests.helpers import BACKWARD, assert_close_scaled, assert_same_metrics

T_LEN = 5  # rollout.max_new_tokens
LR, BETA, MAX_GRAD_NORM, CLIP = 1e-2, 0.1, 1.0, 0.2
# Adam's eps, set in the engine's optimizer and ours (the default is 1e-8). Adam's first step
# is lr * g / (|g| + eps): with eps 1e-8, a gradient within float rounding of 0 moves its
# weight by anything from 0 to lr, and the weights would agree only to ~lr / 100.
ADAM_EPS = 1e-4

# Completion -> its fixed reward. Completions end in EOS unless they fill all T_LEN tokens
# ("c1a2b" is cut off); "" is EOS alone.
REWARDS = {"7": 1.0, "3a7c": 0.25, "b0": -0.5, "77": 2.0, "c1a2b": 0.0, "": 0.5}
COMPLETIONS = list(REWARDS)
# GRPO: two prompts, three completions each (their rows share one prompt pass in the engine).
GRPO_PROMPTS = ["ab"] * 3 + ["cab"] * 3
# PPO: one completion per prompt (every row runs in full in the engine).
PPO_PROMPTS = ["a", "cab", "b0", "c", "ab 1", "ba"]


def fixed_rewards(prompts, completions, **columns):
    return [REWARDS[c] for c in completions]


def fixed_rollout(tokenizer, prompts, group_size, completions=COMPLETIONS):
    """Prompts left-padded to a common length, completions (plus EOS) right-padded to T_LEN."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    completion_ids = [(tokenizer.encode(c, add_special_tokens=False) + [eos])[:T_LEN] for c in completions]
    p_len = max(map(len, prompt_ids))
    ids, attention = [], []
    for p, c in zip(prompt_ids, completion_ids):
        ids.append([pad] * (p_len - len(p)) + p + c + [pad] * (T_LEN - len(c)))
        attention.append([0] * (p_len - len(p)) + [1] * (len(p) + len(c)) + [0] * (T_LEN - len(c)))
    attention = torch.tensor(attention)
    return Rollout(
        input_ids=torch.tensor(ids),
        attention_mask=attention,
        completion_mask=attention[:, p_len:].float(),
        prompts=prompts,
        completions=completions,
        rows=[{"prompt": p} for p in prompts],
        group_size=group_size,
    )


def nudge(model, seed, scale=0.02):
    """Move every weight by seeded Gaussian noise (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def named_grads(models):
    return [{name: p.grad.clone() for name, p in m.named_parameters()} for m in models]


def engine_with_fixed_rollout(make_config, algorithm, prompts, group_size, epochs):
    """The engine as `build_engine` makes it and the fixed rollout it trains on (as a
    generator's batch); its policy moved off the reference. Returns it, the rollout and plain
    copies: reference, policy (and critic)."""
    c = config_from_dict(
        make_config(
            algorithm,
            rollout={
                "group_size": group_size,
                "prompts_per_step": len(prompts) // group_size,
                "max_new_tokens": T_LEN,
                "min_new_tokens": 0,
                "temperature": 1.0,
            },
            train={
                "steps": 1,
                "lr": LR,
                "epochs": epochs,
                "minibatches": 1,
                "micro_batch_size": 0,
                "autocast": "off",
                "max_grad_norm": MAX_GRAD_NORM,
            },
            loss={"beta": BETA},
        )
    )
    e = build_engine(c, [WeightedReward(name="fixed", fn=fixed_rewards, weight=1.0)])
    rollout = fixed_rollout(e.tokenizer, prompts, group_size)
    for group in e.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    reference = copy.deepcopy(e.policy).requires_grad_(False)  # the initial policy, frozen
    trained = [e.policy, *e.critic.networks]
    for seed, model in enumerate(trained):
        nudge(model, seed)
    return e, rollout, reference, [copy.deepcopy(model) for model in trained]


def run_engine(e, rollout):
    """One train_step; the gradients each optimizer step was given ({name: grad} per model)."""
    seen = []
    e.optimizer.torch.register_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(named_grads([e.policy, *e.critic.networks]))
    )
    metrics = train_step(e, rollout).metrics
    return metrics, seen


# ---- the plain implementations ----------------------------------------------------------------


def position_ids(b):
    return (b.attention_mask.cumsum(-1) - 1).clamp(min=0)


def plain_logprobs(model, b):
    """(N, T) log pi(o_t | q, o_<t): the logits at position P-1+t score completion token t."""
    ids = b.input_ids[:, -T_LEN:]
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids(b)).logits
    return torch.log_softmax(logits[:, -T_LEN - 1 : -1].float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def plain_values(critic, b):
    """(N, T) V(q, o_<t): the backbone's hidden state at position P-1+t, through the scalar head."""
    hidden = critic.backbone(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids(b)
    ).last_hidden_state
    return critic.head(hidden[:, -T_LEN - 1 : -1]).squeeze(-1)


def seq_mean_token_mean(x, mask):
    return ((x * mask).sum(1) / mask.sum(1)).mean()


def clipped_surrogate(logprobs, old_logprobs, advantages):
    """-min(rho A, clip(rho, 1 - eps, 1 + eps) A) per token."""
    ratio = torch.exp(logprobs - old_logprobs)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * advantages)


def plain_updates(models, loss_of_epoch, epochs):
    """`epochs` AdamW steps on the whole batch, each model's gradient clipped to MAX_GRAD_NORM.
    Returns the mean loss, the gradients each step was given, the policy's mean grad norm."""
    optimizer = torch.optim.AdamW(
        [p for m in models for p in m.parameters()], lr=LR, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.0
    )
    losses, grads, norms = [], [], []
    for _ in range(epochs):
        loss = loss_of_epoch()
        optimizer.zero_grad()
        loss.backward()
        # Each model clipped on its own, as the engine does; the policy's norm is the metric.
        norms.append([float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_GRAD_NORM)) for m in models][0])
        grads.append(named_grads(models))
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses) / epochs, grads, sum(norms) / epochs


def plain_grpo(policy, reference, b, rewards, group_size, epochs):
    """DeepSeekMath eq. 3 with outcome supervision."""
    mask = b.completion_mask
    groups = rewards.view(-1, group_size)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    with torch.no_grad():
        ref_logprobs, old_logprobs = plain_logprobs(reference, b), plain_logprobs(policy, b)

    def loss():
        logprobs = plain_logprobs(policy, b)
        log_ratio = ref_logprobs - logprobs  # log(pi_ref / pi_theta)
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3, DeepSeekMath eq. 4
        return seq_mean_token_mean(clipped_surrogate(logprobs, old_logprobs, advantages) + BETA * kl, mask)

    return plain_updates([policy], loss, epochs)


def plain_ppo(policy, critic, reference, b, scores, epochs, gamma=1.0, lam=0.95):
    """DeepSeekMath eq. 1-2: KL-penalised per-token rewards, GAE, whitening, clipped losses."""
    mask = b.completion_mask
    with torch.no_grad():
        ref_logprobs, old_logprobs = plain_logprobs(reference, b), plain_logprobs(policy, b)
        old_values = plain_values(critic, b) * mask
    rewards = -BETA * (old_logprobs - ref_logprobs) * mask  # k1 per token
    rewards[torch.arange(len(b)), mask.sum(1).long() - 1] += scores  # the score at the last token
    advantages, running, next_value = torch.zeros_like(rewards), 0.0, 0.0
    for t in reversed(range(T_LEN)):  # values past the last token are 0
        running = rewards[:, t] + gamma * next_value - old_values[:, t] + gamma * lam * running
        advantages[:, t], next_value = running, old_values[:, t]
    returns = advantages + old_values
    valid = advantages[mask.bool()]
    advantages = (advantages - valid.mean()) / torch.sqrt(valid.var() + 1e-8) * mask  # unbiased var

    def loss():
        values = plain_values(critic, b)
        clipped = old_values + torch.clamp(values - old_values, -CLIP, CLIP)
        value_loss = 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / mask.sum()
        return (
            seq_mean_token_mean(clipped_surrogate(plain_logprobs(policy, b), old_logprobs, advantages), mask)
            + value_loss
        )

    return plain_updates([policy, critic], loss, epochs)


# ---- the comparisons --------------------------------------------------------------------------


def assert_same_step(e, metrics, seen, plain, models):
    loss, grads, grad_norm = plain
    assert_same_metrics(metrics, {"loss": loss, "grad_norm": grad_norm})
    assert len(seen) == len(grads)
    assert_close_scaled(seen, grads, BACKWARD)
    for engine_model, mine in zip([e.policy, *e.critic.networks], models):
        assert_close_scaled(engine_model.state_dict(), mine.state_dict())


@pytest.mark.parametrize("epochs", [1, 2])  # 1: the ratio is 1; 2: the second update's ratios move and clip
def test_a_grpo_step_is_deepseekmath_eq3(make_config, epochs):
    e, rollout, reference, models = engine_with_fixed_rollout(make_config, "grpo", GRPO_PROMPTS, 3, epochs)
    metrics, seen = run_engine(e, rollout)
    rewards = torch.tensor([REWARDS[c] for c in COMPLETIONS])
    plain = plain_grpo(models[0], reference, rollout, rewards, 3, epochs)
    assert_same_step(e, metrics, seen, plain, models)
    assert (metrics["clip_fraction"] > 0) == (epochs > 1)  # the second update clips some tokens


def test_a_ppo_step_is_deepseekmath_eq1_eq2(make_config):
    e, rollout, reference, models = engine_with_fixed_rollout(make_config, "ppo", PPO_PROMPTS, 1, epochs=2)
    metrics, seen = run_engine(e, rollout)
    scores = torch.tensor([REWARDS[c] for c in COMPLETIONS])
    plain = plain_ppo(*models, reference, rollout, scores, epochs=2)
    assert_same_step(e, metrics, seen, plain, models)
    assert metrics["clip_fraction"] > 0
