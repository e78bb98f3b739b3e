"""Small builders shared by the tests."""

import torch


def right_padded_mask(lengths, t_len):
    """(N, T) mask with the first lengths[i] entries of row i set, as completions are."""
    lengths = torch.as_tensor(lengths)
    return (torch.arange(t_len).unsqueeze(0) < lengths.unsqueeze(1)).float()


def random_batch(seed, n, t_len, *, min_len=1):
    """Log-probs of a policy and an older policy, advantages and a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(n, t_len, generator=g, dtype=torch.float64) * 3
    old_logprobs = logprobs + 0.3 * torch.randn(n, t_len, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(min_len, t_len + 1, (n,), generator=g)
    return logprobs, old_logprobs, advantages, right_padded_mask(lengths, t_len).double()


def run_generator(c, e, tools=None):
    """The generator a run of config `c` builds for engine `e` (grpo.train.loop), the policy's
    current weights published to it."""
    from grpo.train.loop import build_run_generator

    generator = build_run_generator(c, e, tools)
    generator.publish(e.policy, e.version)
    return generator


def sample(e, generator, rows, seeds=None, step=0):
    """`rows`' rollout, drawn by `generator` with the policy's current weights (published
    first when the generator holds older ones), as the loop takes a step's batch."""
    if generator.published != e.version:
        generator.publish(e.policy, e.version)
    generator.request(step, rows, seeds)
    return generator.take(step)


def sampled_step(e, generator, rows, seeds=None, step=0):
    """One training step on `rows`, sampled by `generator` (the loop's take, then train_step)."""
    from grpo.train.step import train_step

    return train_step(e, sample(e, generator, rows, seeds, step), step)


def the_reward_model_update(output_dir, before_dir) -> dict:
    """The one reward-model update an iterative run (saving its reward model) recorded in
    `output_dir`, checked to have moved the reward model away from the one in `before_dir`."""
    import json
    from pathlib import Path

    from grpo.rewards.model import RewardModel

    (update,) = [
        json.loads(line) for line in (Path(output_dir) / "reward_model_updates.jsonl").read_text().splitlines()
    ]
    before = RewardModel.from_pretrained(str(before_dir)).model.state_dict()
    after = RewardModel.from_pretrained(str(Path(output_dir) / "reward_model")).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the reward model did not move"
    return update


# ---- numeric comparisons: float rounding scales with the values and the dtype, never with 1 ----

# Tolerances in units of the dtype's epsilon times the values' largest magnitude. Rounding in a
# tiny model's pass, compared across layouts or kernels (another blocking, another summation
# order: what differs from one CPU kind to another), leaves a few tens of units; a wrong mask,
# position or slot moves the values by a good fraction of their scale, about 1/eps units. A
# planted bug is caught where it moves them by more than FAR times the bound.
FORWARD = 128  # log-probs, entropies, scores or values of one forward
BACKWARD = 512  # gradients: a backward sums over every position and layer too
FAR = 100


def scale_of(*tensors) -> float:
    """The largest magnitude among `tensors` (0.0 when all are empty)."""
    found = [torch.as_tensor(t).detach() for t in tensors]
    return max((float(t.abs().max()) for t in found if t.numel()), default=0.0)


def logprob_scale(*logprobs) -> float:
    """The scale of log-probs' rounding where their logits are not at hand: a log-prob is a
    logit less the log-sum-exp, whose rounding is of order 1 or more even where the log-prob
    itself is near 0 (a peaked distribution)."""
    return max(1.0, scale_of(*logprobs))


def gap(got, want, dtype: torch.dtype | None = None, *, scale: float | None = None) -> float:
    """The largest |got - want| in epsilons of `dtype` (want's by default) times the values'
    scale: the larger of the two's largest magnitude, or `scale` where rounding scales with
    something else (an entropy, lse - E[x], with its logits). 0.0 where they are equal."""
    got, want = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    difference = float((got.to(want.dtype) - want).abs().max()) if want.numel() else 0.0
    if not difference:
        return 0.0
    return difference / (torch.finfo(dtype or want.dtype).eps * (scale_of(got, want) if scale is None else scale))


def assert_close_scaled(
    got, want, units: float = FORWARD, *, dtype: torch.dtype | None = None, scale: float | None = None, msg=None
):
    """`got` equals `want` to float rounding: every element within `units` epsilons of `dtype`
    (want's by default) times the values' scale (as `gap` takes them). Dicts, lists and tuples
    of tensors (gradients, state dicts) compare entry by entry, each to its own scale."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), (msg, sorted(got), sorted(want))
        for key in want:
            assert_close_scaled(got[key], want[key], units, dtype=dtype, scale=scale, msg=f"{msg or ''} {key}".strip())
        return
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want), (msg, len(got), len(want))
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close_scaled(a, b, units, dtype=dtype, scale=scale, msg=f"{msg or ''} [{i}]".strip())
        return
    got, want = torch.as_tensor(got).detach(), torch.as_tensor(want).detach()
    atol = units * torch.finfo(dtype or want.dtype).eps * (scale_of(got, want) if scale is None else scale)
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=msg)


# What `update_gap` allows between two updates that differ in float rounding alone: a wrong
# gradient (a micro-batch dropped, a scale off) moves it by order 1.
UPDATE = 0.02


def update_gap(before: dict, got: dict, want: dict) -> float:
    """How far the update `got - before` is from `want - before`, relative to the latter's
    norm (state dicts by name). Adam's first steps move a weight by about lr whatever its
    gradient's size, so a gradient that is float rounding in both runs may step either way:
    weight by weight the two differ by about lr there, while the whole update's norm, which a
    few such weights barely change, moves with any wrong gradient."""
    names = [name for name in want if want[name].is_floating_point()]
    moved = torch.cat([(got[k].double() - before[k].double()).flatten() for k in names])
    wanted = torch.cat([(want[k].double() - before[k].double()).flatten() for k in names])
    assert wanted.norm() > 0, "the reference run did not move the weights"
    return float((moved - wanted).norm() / wanted.norm())


def assert_same_metrics(got: dict, want: dict, keys=None, units: float = FORWARD):
    """Metrics of one step computed two ways (floats) equal to float rounding: each within
    `units` float32 epsilons of the larger of its magnitude and 1, the scale of the per-token
    terms (log-probs, ratios, advantages) that a loss or a KL averages and may cancel to near 0.
    Entries that are not numbers (None: nothing measured) must be equal."""
    for key in want if keys is None else keys:
        if not isinstance(want[key], (int, float, torch.Tensor)) or isinstance(want[key], bool):
            assert got[key] == want[key], (key, got[key], want[key])
            continue
        scale = max(abs(float(got[key])), abs(float(want[key])), 1.0)
        bound = units * torch.finfo(torch.float32).eps * scale
        assert abs(float(got[key]) - float(want[key])) <= bound, (key, got[key], want[key], bound)
