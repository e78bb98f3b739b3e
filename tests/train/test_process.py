"""Process supervision: step rewards reach the tokens through process_advantages."""

import pytest
import torch

import grpo
import grpo.train.seams as seams_module
from grpo.rewards import WeightedReward, score_steps
from grpo.tasks.tiny import char_tokenizer
from grpo.rollout import Rollout
from grpo.train.seams import ProcessBaseline


def test_step_rewards_land_on_the_tokens_that_end_the_steps():
    tok = char_tokenizer("0123456789;")
    completions = ["12;7", "9"]
    ids = [tok(c)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(map(len, ids))
    completion_ids = torch.tensor([row + [tok.pad_token_id] * (width - len(row)) for row in ids])
    mask = (torch.arange(width) < torch.tensor([[len(r)] for r in ids])).float()
    batch = Rollout(completion_ids, mask.long(), mask, ["", ""], completions, [{}, {}], group_size=2)

    def steps(prompts, completions, **columns):
        return [[(3, 1.0), (4, 0.5)], 0.25]  # a process reward and an outcome number

    scored = score_steps([WeightedReward("s", steps, 2.0)], ["", ""], completions, {})
    assert scored.steps == [[(3, 2.0), (4, 1.0)], [(1, 0.5)]]
    torch.testing.assert_close(scored.total, torch.tensor([1.5, 0.5]))
    rewards, ends = ProcessBaseline(2, 1e-4, tok).step_tensors(scored.steps, batch)
    assert ends.tolist() == [[2, 3], [0, -1]]  # '12;' ends at token 2, '7' at token 3
    assert torch.isnan(rewards[1, 1]) and rewards[0].tolist() == [2.0, 1.0]


def test_an_empty_completion_takes_its_steps_at_its_only_token():
    # A completion that is an EOS at once: the arithmetic task's step reward (and a plain
    # number) put its one step at offset 0; it lands on the EOS token. Offsets past it fail.
    from grpo.errors import UserError
    from grpo.tasks.arithmetic import step_reward

    tok = char_tokenizer("0123456789;+=>")
    completions = ["", "1+2+0=03>3"]
    scored = score_steps([WeightedReward("arithmetic_steps", step_reward, 1.0)], ["1+2=", "1+2="], completions, {})
    assert scored.steps == [[(0, 0.0)], [(8, 1.0), (10, 1.0)]]
    ids = [[tok.eos_token_id], tok(completions[1])["input_ids"] + [tok.eos_token_id]]
    width = max(map(len, ids))
    completion_ids = torch.tensor([row + [tok.pad_token_id] * (width - len(row)) for row in ids])
    mask = (torch.arange(width) < torch.tensor([[len(r)] for r in ids])).float()
    batch = Rollout(completion_ids, mask.long(), mask, ["1+2=", "1+2="], completions, [{}, {}], group_size=2)
    rewards, ends = ProcessBaseline(2, 1e-4, tok).step_tensors(scored.steps, batch)
    assert ends[0, 0] == 0 and rewards[0, 0] == 0.0
    with pytest.raises(UserError, match="character offset in 1..0"):
        score_steps([WeightedReward("s", lambda prompts, completions, **c: [[(2, 1.0)]], 1.0)], [""], [""], {})
    with pytest.raises(UserError, match="character offset in 1..3"):
        score_steps([WeightedReward("s", lambda prompts, completions, **c: [[(0, 1.0)]], 1.0)], [""], ["abc"], {})


def test_grpo_learns_from_step_rewards_through_process_advantages(make_config, monkeypatch):
    calls = []
    real = seams_module.process_advantages
    monkeypatch.setattr(seams_module, "process_advantages", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = make_config(
        rewards=[{"function": "tests.train.rewards_for_tests:sevens_steps"}],
        loss={"supervision": "process"},
        train={"steps": 40, "lr": 1e-3, "sample_every": 10},
    )
    metrics = grpo.train(config, progress=False).metrics
    assert len(calls) == 40
    rewards = [m["reward/mean"] for m in metrics]  # the mean step reward per completion
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.25, [round(r, 3) for r in rewards]
