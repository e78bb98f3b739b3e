"""Passes cut to their micro-batch's longest completion, and micro-batches of similar lengths
(train.length_grouping): the same log-probs, values and gradients as full-width passes,
fewer padding positions through the model."""

import math

import pytest
import torch

from grpo.config import config_from_dict
from grpo.rewards import WeightedReward
from grpo.rollout import Rollout
from grpo.train.loop import build_engine
from grpo.train.layouts import completion_logprobs, micro_batches
from grpo.train.networks import ValueModel
from grpo.train.step import train_step
from tests.helpers import BACKWARD, assert_close_scaled, assert_same_metrics
from tests.train.test_assembled_step import ADAM_EPS, named_grads, nudge
from tests.train.test_models import model_of, rollout

T_LEN = 9  # rollout.max_new_tokens of the fixed rollouts


def hand_rollout(prompt_ids, completion_ids, t_len, group_size=1, pad=0):
    """Prompts (token lists) left-padded to the longest, completions right-padded to t_len."""
    p_len = max(map(len, prompt_ids))
    ids, attention, completion = [], [], []
    for p, c in zip(prompt_ids, completion_ids):
        ids.append([pad] * (p_len - len(p)) + p + c + [pad] * (t_len - len(c)))
        attention.append([0] * (p_len - len(p)) + [1] * (len(p) + len(c)) + [0] * (t_len - len(c)))
        completion.append([1.0] * len(c) + [0.0] * (t_len - len(c)))
    n = len(ids)
    return Rollout(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(attention),
        completion_mask=torch.tensor(completion),
        prompts=[""] * n,
        completions=[""] * n,
        rows=[{"prompt": str(i // group_size)} for i in range(n)],
        group_size=group_size,
    )


# ---- the trimmed rollout ----------------------------------------------------------------------


def test_trimmed_drops_exactly_the_columns_that_are_padding_in_every_row():
    batch = hand_rollout([[5, 6, 7], [8], [9, 9]], [[1, 2], [3], [4, 4, 2]], t_len=6)  # P = 3, T = 6
    part = batch.select(torch.tensor([1, 2]), trim=True)  # prompts of 1 and 2 tokens, completions of 1 and 3
    assert part.input_ids.tolist() == [[0, 8, 3, 0, 0], [9, 9, 4, 4, 2]]
    assert part.completion_mask.shape == (2, 3) and part.completion_ids.tolist() == [[3, 0, 0], [4, 4, 2]]
    # Positions count real tokens only: the kept columns keep theirs.
    torch.testing.assert_close(part.position_ids, batch.select(torch.tensor([1, 2])).position_ids[:, 1:6])
    assert part.fit(torch.arange(12.0).view(2, 6)).tolist() == [[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]
    assert part.fit(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]  # per sequence: as it is
    assert batch.trimmed().input_ids.shape == (3, 3 + 3)  # the longest prompt, the longest completion
    assert batch.select(torch.tensor([0])).trimmed().input_ids.tolist() == [[5, 6, 7, 1, 2]]
    # A row set whose masks are all empty (a weightless pass) keeps one column of each.
    empty = batch.select(torch.tensor([1]))
    empty.completion_mask = torch.zeros_like(empty.completion_mask)
    assert empty.trimmed().input_ids.tolist() == [[8, 3]]
    full = hand_rollout([[5]], [[1, 2]], t_len=2)
    assert full.trimmed() is full


def test_micro_batches_order_rows_or_whole_groups_by_length():
    # Two groups of 3 (G = 3): lengths 1 8 2 | 5 3 9.
    lengths = [1, 8, 2, 5, 3, 9]
    batch = hand_rollout([[5]] * 6, [[1] * k for k in lengths], t_len=9, group_size=3)
    rows = torch.arange(6)
    as_is = [m.tolist() for m in micro_batches(batch, rows, 2)]
    assert as_is == [[0, 1], [2, 3], [4, 5]]
    assert [m.tolist() for m in micro_batches(batch, rows, 2, by_length=True, whole_groups=False)] == [
        [5, 1],
        [3, 4],
        [2, 0],
    ]
    assert [m.tolist() for m in micro_batches(batch, rows, 2, by_length=True)] == [[5, 3], [4, 1], [2, 0]]
    # A minibatch's rows in any order: a group's rows come together, the longest group first.
    assert [m.tolist() for m in micro_batches(batch, torch.tensor([4, 0, 5, 1]), 0, by_length=True)] == [[5, 4, 1, 0]]
    for size in range(0, 8):  # the same number of micro-batches (of passes, under several processes)
        for by_length in (False, True):
            got = micro_batches(batch, rows, size, by_length=by_length)
            assert len(got) == (math.ceil(6 / size) if size else 1)
            assert sorted(torch.cat(got).tolist()) == list(range(6))


# ---- a trimmed pass computes what the full-width pass does --------------------------------------


def assert_close_gradients(got, want, tolerance=1e-10):
    """In float64, where the passes' other sums in another order agree to ~1e-12 (in float32
    these peaked models' gradients agree only to ~1e-5 of their size, cut or not)."""
    assert float((got - want).norm() / want.norm()) < tolerance
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance * float(want.abs().max()))


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("chunked_head", [False, True])
def test_a_trimmed_pass_gives_the_full_width_log_probs_and_gradients(share_prompts, chunked_head):
    model = model_of(eos_bias=1.5)  # rows end early
    batch = rollout(model, ["a", "bc1", "cab 7"], max_new_tokens=8)
    model.double()
    short = batch.completion_lengths.argsort()[:5].sort().values  # the shortest rows, some of them sharing a prompt
    part = batch.select(short)
    trimmed = part.trimmed()
    assert trimmed.completion_mask.shape[1] < part.completion_mask.shape[1]  # there is something to trim
    weights = torch.linspace(-1, 1, part.completion_mask.numel(), dtype=torch.float64).view_as(
        part.completion_mask
    )  # a loss per token
    results = []
    for b in (part, trimmed):
        model.zero_grad()
        logprobs, _ = completion_logprobs(model, b, 0.7, 1.3, share_prompts=share_prompts, chunked_head=chunked_head)
        (logprobs * b.fit(weights) * b.completion_mask).sum().backward()
        results.append((trimmed.fit(logprobs.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])))
    mask = trimmed.completion_mask.bool()
    # float32 log-probs of float64 passes: equal but where a cast rounds the other way
    assert_close_scaled(results[1][0][mask], results[0][0][mask], 2)
    assert (part.completion_mask[:, trimmed.completion_mask.shape[1] :] == 0).all()  # nothing scored was cut
    assert_close_gradients(results[1][1], results[0][1])


def test_a_trimmed_critic_pass_gives_the_full_width_values_and_gradients():
    model = model_of(eos_bias=0.8)
    batch = rollout(model, ["cab 7", "ab"], max_new_tokens=8)
    critic = ValueModel(model.model.double(), 64)  # the backbone in float64; the head reads float32
    torch.nn.init.normal_(critic.head.weight)
    part = batch.select(torch.arange(3, 6))  # the short prompt's group
    trimmed = part.trimmed()
    p_len, t_len = part.input_ids.shape[1] - part.completion_mask.shape[1], part.completion_mask.shape[1]
    assert (
        trimmed.completion_mask.shape[1] < t_len
        and trimmed.input_ids.shape[1] - trimmed.completion_mask.shape[1] == 2 < p_len
    )
    results = []
    for b in (part, trimmed):
        critic.zero_grad()
        values = critic(b)
        (values * b.completion_mask).sum().backward()
        results.append((trimmed.fit(values.detach()), torch.cat([p.grad.flatten() for p in critic.parameters()])))
    mask = trimmed.completion_mask.bool()
    assert_close_scaled(results[1][0][mask], results[0][0][mask])  # the float32 head's rounding
    assert_close_gradients(results[1][1], results[0][1], tolerance=1e-6)


# ---- the step ---------------------------------------------------------------------------------

# Completion (EOS added unless it fills T_LEN) -> its reward: lengths 1 to 9 with EOS.
REWARDS = {
    "": 0.5,
    "7": 1.0,
    "b0": -0.5,
    "3a7": 0.25,
    "77c1": 2.0,
    "c1a2b": 0.0,
    "1a2b3c": -1.0,
    "7777777": 1.5,
    "ab ab ab ": 0.75,
}


def rewards_by_text(prompts, completions, **columns):
    return [REWARDS[c] for c in completions]


def fixed_rollout(tokenizer, prompts, completions, group_size):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    batch = hand_rollout(
        [tokenizer.encode(p, add_special_tokens=False) for p in prompts],
        [(tokenizer.encode(c, add_special_tokens=False) + [eos])[:T_LEN] for c in completions],
        T_LEN,
        group_size,
        pad,
    )
    batch.prompts, batch.completions, batch.rows = list(prompts), list(completions), [{"prompt": p} for p in prompts]
    return batch


# GRPO: two prompts of different lengths, four completions each; PPO: one completion per prompt.
CASES = {
    "grpo": (["ab"] * 4 + ["cab 1"] * 4, ["7", "ab ab ab ", "", "3a7", "b0", "77c1", "1a2b3c", "c1a2b"], 4),
    "ppo": (
        ["a2", "c", "b0", "b", "ab", "ba", "1", "a"],
        ["ab ab ab ", "7", "77c1", "", "b0", "1a2b3c", "3a7", "7777777"],
        1,
    ),
}


def engine_on_fixed_rollout(
    make_config, algorithm, aggregation, length_grouping, micro_batch_size=3, epochs=2, minibatches=2
):
    prompts, completions, group_size = CASES[algorithm]
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
                "lr": 1e-2,
                "epochs": epochs,
                "minibatches": minibatches,
                "micro_batch_size": micro_batch_size,
                "autocast": "off",
                "length_grouping": length_grouping,
                "layout": "padded",  # the layout that trimming and grouping cut (the packed one holds no padding)
            },
            loss={"beta": 0.1, "aggregation": aggregation},
        )
    )
    e = build_engine(c, [WeightedReward(name="fixed", fn=rewards_by_text, weight=1.0)])
    batch = fixed_rollout(e.tokenizer, prompts, completions, group_size)
    for group in e.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    for seed, model in enumerate([e.policy, *e.critic.networks]):
        nudge(model, seed)  # off the reference, the critic's head off 0: nothing is 0 by accident
    return e, batch


def step_gradients(e, batch):
    """One train_step; the gradients each optimizer step was given, and the metrics."""
    seen, positions = [], []
    e.optimizer.torch.register_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(named_grads([e.policy, *e.critic.networks]))
    )
    e.policy.get_input_embeddings().register_forward_pre_hook(lambda module, args: positions.append(args[0].numel()))
    torch.manual_seed(0)  # the minibatches' permutation
    metrics = train_step(e, batch).metrics
    return seen, metrics, sum(positions)


def assert_same_gradients(got, want):
    """Each optimizer step's gradient of each model, to float32 rounding of its size."""
    assert len(got) == len(want) == 4  # two epochs of two minibatches
    for got_step, want_step in zip(got, want):
        for got_model, want_model in zip(got_step, want_step):
            assert got_model.keys() == want_model.keys()
            g, w = (torch.cat([grads[k].flatten() for k in want_model]) for grads in (got_model, want_model))
            assert_close_scaled(g, w, BACKWARD)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_trimmed_and_length_grouped_steps_give_the_full_width_gradients(
    make_config, monkeypatch, algorithm, aggregation
):
    """Old and reference log-probs, per-token advantages, values and returns are cut with the
    micro-batch (PPO's are per token): the gradients of every update, with grouping on and off,
    are those of passes over the full width."""
    runs = {}
    for name, grouping in (("grouped", True), ("trimmed", False)):
        runs[name] = step_gradients(*engine_on_fixed_rollout(make_config, algorithm, aggregation, grouping))
    with monkeypatch.context() as m:
        m.setattr(Rollout, "trimmed", lambda self: self)  # every pass at the full width
        runs["full"] = step_gradients(*engine_on_fixed_rollout(make_config, algorithm, aggregation, False))
    for name in ("trimmed", "grouped"):
        assert_same_gradients(runs[name][0], runs["full"][0])
        # clip_fraction is a mean over micro-batches (of each one's fraction of tokens, weighted
        # by its rows): other micro-batches, another mean.
        keys = ("loss", "kl", "entropy", "value_loss") + (("clip_fraction",) if name == "trimmed" else ())
        assert_same_metrics(runs[name][1], runs["full"][1], [k for k in keys if runs["full"][1].get(k) is not None])
    assert runs["full"][1]["clip_fraction"] > 0  # the ratios moved off 1: the old log-probs matter
    assert runs["full"][2] > runs["trimmed"][2] > runs["grouped"][2]  # the policy's passes saw fewer positions


def test_length_grouping_sends_fewer_padding_positions_through_the_model(make_config, monkeypatch):
    """PPO (one completion per prompt, no prompt shared), 8 rows in micro-batches of 2: the
    policy's embedding sees each pass's rows at its width. Completion lengths (with EOS) in
    row order 9 2 5 1 3 7 4 8, prompts 1 or 2 tokens wide; one old-policy pass and one update.
    Full width 88 positions a pass, cut to each micro-batch 72, grouped by length 58."""
    counts = {}
    for name, grouping in (("full", False), ("trimmed", False), ("grouped", True)):
        with monkeypatch.context() as m:
            if name == "full":
                m.setattr(Rollout, "trimmed", lambda self: self)
            e, batch = engine_on_fixed_rollout(
                make_config, "ppo", "token-mean", grouping, micro_batch_size=2, epochs=1, minibatches=1
            )
            seen = []
            hook = e.policy.get_input_embeddings().register_forward_pre_hook(
                lambda module, args: seen.append(args[0].numel())
            )
            train_step(e, batch)
            hook.remove()
        assert len(seen) == 8  # 4 micro-batches, twice: the same passes
        counts[name] = sum(seen)
    assert batch.completion_lengths.long().tolist() == [9, 2, 5, 1, 3, 7, 4, 8]
    # Per micro-batch of two rows: 2 x (prompt columns + completion columns).
    assert counts["full"] == 2 * sum(2 * (2 + 9) for _ in range(4))
    assert counts["trimmed"] == 2 * 2 * ((2 + 9) + (2 + 5) + (2 + 7) + (1 + 8))  # rows (0 1) (2 3) (4 5) (6 7)
    assert counts["grouped"] == 2 * 2 * ((2 + 9) + (2 + 7) + (2 + 4) + (1 + 2))  # rows (0 7) (5 2) (6 4) (1 3)
