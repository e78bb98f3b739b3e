"""train.micro_batch_tokens: the update's micro-batches filled up to a number of real tokens
(verl's dynamic batch size). Each micro-batch within the budget (a longer row alone), every
row once, in order; a group's prompt counted once where the pass shares it; and the update
the same as the whole minibatch's in one pass (the loss's denominators are the minibatch's)."""

import pytest
import torch

import grpo.train.step as step
from grpo.errors import UserError
from grpo.train.layouts import micro_batches, token_budget_split
from grpo.train.packed_layout import prompt_groups, real_lengths
from tests.algo.test_chunked_head import batch_of
from tests.helpers import UPDATE, update_gap
from tests.train.test_engine import engine_for, train_step


def test_micro_batches_stay_within_the_budget_and_keep_every_row_in_order():
    batch = batch_of(40, prompts=4, group_size=3, p_len=5, t_len=7, seed=3)
    real = batch.attention_mask.sum(1)
    rows = torch.arange(len(batch))
    for budget in (1, 9, 14, 30, 1000):
        parts = token_budget_split(batch, rows, budget, whole_groups=False)
        assert torch.equal(torch.cat(parts), rows)  # every row once, in order
        for part in parts:
            assert len(part) == 1 or int(real[part].sum()) <= budget
        # a budget that fits the next row is never cut early
        for part, following in zip(parts, parts[1:]):
            assert int(real[part].sum()) + int(real[following[0]]) > budget
    assert len(token_budget_split(batch, rows, 1000, whole_groups=False)) == 1
    assert len(token_budget_split(batch, rows, 1, whole_groups=False)) == len(batch)


def test_a_shared_prompt_counts_once_per_micro_batch():
    batch = batch_of(40, prompts=2, group_size=3, p_len=5, t_len=7, seed=3)
    real, completion = batch.attention_mask.sum(1), batch.completion_lengths
    group = torch.arange(3)  # one group: its prompt once, then each completion
    budget = int(real[0] + completion[1:3].sum())
    assert len(token_budget_split(batch, group, budget, whole_groups=True)) == 1
    assert len(token_budget_split(batch, group, budget, whole_groups=False)) > 1


def _packed_tokens(batch, part) -> int:
    """The real tokens the packed layout runs for the rows `part`: each completion, and a
    prompt once for each run of adjacent rows that share it (prompt_groups)."""
    rows = batch.select(part)
    prompt, completion = real_lengths(rows)
    found = prompt_groups(rows)
    starts = found[0] if found is not None else torch.arange(len(rows))
    return int(completion.sum() + prompt[starts].sum())


@pytest.mark.parametrize("order", ["grouped", "interleaved", "shuffled"])
def test_the_budget_holds_for_the_packed_pass_in_every_row_order(order):
    batch = batch_of(40, prompts=2, group_size=4, p_len=8, t_len=4, seed=2)
    rows = torch.arange(len(batch))
    if order == "interleaved":  # a minibatch without length grouping: groups' rows apart
        rows = rows.view(2, 4).t().reshape(-1)
    elif order == "shuffled":
        rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))]
    for budget in range(8, 60, 4):
        parts = token_budget_split(batch, rows, budget, whole_groups=True)
        assert torch.equal(torch.cat(parts), rows)
        for part in parts:
            assert len(part) == 1 or _packed_tokens(batch, part) <= budget, (order, budget, part)


def test_micro_batches_takes_the_budget_after_ordering_by_length():
    batch = batch_of(40, prompts=3, group_size=3, p_len=5, t_len=7, seed=1)
    rows = torch.arange(len(batch))
    ordered = torch.cat(micro_batches(batch, rows, 0, by_length=True))
    parts = micro_batches(batch, rows, 0, by_length=True, tokens=12)
    assert len(parts) > 1 and torch.equal(torch.cat(parts), ordered)


def test_a_token_budget_gives_the_same_update_as_the_whole_batch(make_config, monkeypatch):
    passes, weights, norms = [], [], []
    for tokens in (0, 12):  # 12: a few rows a pass, groups cut apart
        e, c, stream = engine_for(make_config(train={"micro_batch_tokens": tokens, "lr": 1e-3}))
        made = []
        monkeypatch.setattr(step, "micro_batches", lambda *a, **k: made.append(micro_batches(*a, **k)) or made[-1])
        before = {k: v.clone() for k, v in e.policy.state_dict().items()}
        result = train_step(e, stream.take(c.rollout.prompts_per_step))
        passes.append(len(made[-1]))
        weights.append({k: v.clone() for k, v in e.policy.state_dict().items()})
        norms.append(result.metrics["grad_norm"])
    assert passes[0] == 1 and passes[1] > 2
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)  # the gradient's scale (Adam's step would hide it)
    assert update_gap(before, weights[1], weights[0]) < UPDATE


def test_the_step_in_the_backward_refuses_a_token_budget(make_config):
    with pytest.raises(UserError, match="train.micro_batch_tokens"):
        engine_for(make_config(train={"optimizer_in_backward": True, "max_grad_norm": 0, "micro_batch_tokens": 64}))
