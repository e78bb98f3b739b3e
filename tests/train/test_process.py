"""Process supervision: step rewards reach the tokens through process_advantages."""

import pytest
import torch

import grpo
import grpo.train.seams as seams_module
from grpo.algo import process_advantages
from grpo.rewards import WeightedReward, score_steps
from grpo.tasks.arithmetic import ALPHABET, step_reward
from grpo.tasks.tiny import char_tokenizer
from grpo.rollout import Rollout
from grpo.train.scorers import ProcessScorer
from grpo.train.seams import ProcessBaseline


def _batch(tok, prompts, completions):
    """One group: each completion as a character tokenizer's tokens, then EOS, right-padded."""
    ids = [tok(c)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(map(len, ids))
    completion_ids = torch.tensor([row + [tok.pad_token_id] * (width - len(row)) for row in ids])
    mask = (torch.arange(width) < torch.tensor([[len(r)] for r in ids])).float()
    return Rollout(completion_ids, mask.long(), mask, prompts, completions, [{}] * len(ids), group_size=len(ids))


def test_step_rewards_land_on_the_tokens_that_end_the_steps():
    tok = char_tokenizer("0123456789;")
    completions = ["12;7", "9"]
    batch = _batch(tok, ["", ""], completions)

    def steps(prompts, completions, **columns):
        return [[(3, 1.0), (4, 0.5)], 0.25]  # a process reward and an outcome number

    scored = score_steps([WeightedReward("s", steps, 2.0)], ["", ""], completions, {})
    assert scored.steps == [[(3, 2.0), (4, 1.0)], [(1, 0.5)]]
    torch.testing.assert_close(scored.total, torch.tensor([1.5, 0.5]))
    baseline = ProcessBaseline(2, 1e-4, tok)
    rewards, ends = baseline.step_tensors(scored.steps, batch)
    assert ends.tolist() == [[2, 3], [0, -1]]  # '12;' ends at token 2, '7' at token 3
    assert torch.isnan(rewards[1, 1]) and rewards[0].tolist() == [2.0, 1.0]

    def expecting(prompts, completions, **columns):  # one step left out of each
        return [{"steps": [(3, 1.0), (4, 0.5)], "expected": 3}, {"steps": [(1, 1.0)], "expected": 2}]

    scored = score_steps([WeightedReward("s", expecting, 1.0)], ["", ""], completions, {})
    assert scored.steps == [[(3, 1.0), (4, 0.5), (5, 0.0)], [(1, 1.0), (2, 0.0)]]
    _, ends = baseline.step_tensors(scored.steps, batch)
    assert ends.tolist() == [[2, 3, 4], [0, 1, -1]]  # a step left out: past the text, on the EOS


def test_an_empty_completion_takes_its_steps_at_its_only_token():
    # A completion that is an EOS at once: a plain number puts its one step at offset 0, and
    # the arithmetic task's step and answer, both left out, are at offset 1 (past its empty
    # text); all land on the EOS token. Offsets past it that a function gives fail.
    from grpo.errors import UserError

    tok = char_tokenizer(ALPHABET)
    completions = ["", "1+2+0=03>3"]
    rewards = [
        WeightedReward("arithmetic_steps", step_reward, 1.0),
        WeightedReward("n", lambda p, c, **_: [0.5, None], 1.0),
    ]
    scored = score_steps(rewards, ["1+2=", "1+2="], completions, {})
    assert scored.steps == [[(0, 0.5), (1, 0.0), (1, 0.0)], [(8, 1.0), (11, 1.0)]]
    batch = _batch(tok, ["1+2=", "1+2="], completions)
    rewards, ends = ProcessBaseline(2, 1e-4, tok).step_tensors(scored.steps, batch)
    assert ends[0].tolist() == [0, 0, 0] and rewards[0].tolist() == [0.5, 0.0, 0.0]
    with pytest.raises(UserError, match="character offset in 1..1"):
        score_steps([WeightedReward("s", lambda prompts, completions, **c: [[(2, 1.0)]], 1.0)], [""], [""], {})
    with pytest.raises(UserError, match="character offset in 1..4"):
        score_steps([WeightedReward("s", lambda prompts, completions, **c: [[(0, 1.0)]], 1.0)], [""], ["abc"], {})


def test_stopping_early_earns_no_more_than_finishing_wrongly():
    # Issue 24: a completion that stopped after its first (right) column escaped the
    # negative normalised rewards of the items it left out, so each of its tokens (its EOS,
    # the choice to stop, included) had a higher advantage than a complete wrong answer's,
    # and the policy learned to stop. The items it leaves out now score 0.0 (wrong) on its EOS.
    tok = char_tokenizer(ALPHABET)
    completions = [
        "7+5+0=12",  # stops after one right step: leaves out the tens step and the answer
        "7+5+0=12;4+8+0=12>122",  # complete; the tens step (carry forgotten) and the answer wrong
        "7+5+0=12;4+8+1=13>132",  # right
        "7+5+0=13;4+8+1=13>133",  # complete; the ones step and the answer wrong
    ]
    prompts = ["47+85="] * len(completions)
    batch = _batch(tok, prompts, completions)
    scored = ProcessScorer()([WeightedReward("arithmetic_steps", step_reward, 1.0)], prompts, completions, {})
    assert scored.steps[0] == [(8, 1.0), (9, 0.0), (9, 0.0)]  # the tens step and the answer left out
    assert [len(s) for s in scored.steps] == [3, 3, 3, 3]  # K = 2 columns + the answer, each
    rewards, ends = ProcessBaseline(4, 1e-4, tok).step_tensors(scored.steps, batch)
    advantages = process_advantages(rewards, ends, batch.loss_mask, 4)  # (4, T)
    truncated, wrong = advantages[0], advantages[1]
    tokens = int(batch.loss_mask[0].sum())  # its characters, then its EOS
    assert (truncated[:tokens] <= wrong[:tokens] + 1e-6).all(), (truncated[:tokens], wrong[:tokens])
    assert truncated[:tokens].sum() < 0  # a wrong finish's score, not a free stop


def test_a_watched_outcome_reward_does_not_make_dropping_the_answer_pay():
    # Issue 24: the demo's process arm watches the final answer with `arithmetic_correct` at
    # weight 0. Its steps entered the group's normalisation as a 0 at each completion's end,
    # so a completion that stopped before its answer escaped it at the token that chose to
    # stop, and the policy learned to drop its answers. Weight 0 is watched, not trained on.
    from grpo.tasks.arithmetic import correctness_reward

    tok = char_tokenizer(ALPHABET)
    completions = [
        "7+5+0=12;4+8+1=13",  # right steps, no answer
        "7+5+0=12;4+8+1=13>133",  # right steps, wrong answer
        "7+5+0=12;4+8+1=13>132",  # right
        "7+5+0=13;4+8+1=13>133",  # the ones step and the answer wrong
    ]
    prompts = ["47+85="] * len(completions)
    batch = _batch(tok, prompts, completions)
    steps = WeightedReward("arithmetic_steps", step_reward, 1.0)
    watched = WeightedReward("arithmetic_correct", correctness_reward, 0.0)
    alone = ProcessScorer()([steps], prompts, completions, {})
    both = ProcessScorer()([steps, watched], prompts, completions, {})
    assert both.steps == alone.steps
    assert both.per_function["arithmetic_correct"].tolist() == [0.0, 0.0, 1.0, 0.0]  # still watched
    rewards, ends = ProcessBaseline(4, 1e-4, tok).step_tensors(both.steps, batch)
    advantages = process_advantages(rewards, ends, batch.loss_mask, 4)  # (4, T)
    stop = len(completions[0])  # the EOS of the first, the '>' of the second: the choice to answer
    assert advantages[0, stop] <= advantages[1, stop] + 1e-6


def test_stopping_inside_a_wrong_answer_is_judged_with_it():
    # Issue 24: with the answer's reward on its last character, the EOS after it had no step
    # at or after it (advantage 0), while every digit of a wrong answer had a negative one,
    # so the process arm learned to stop one digit into its answers (">1" for 132). The
    # answer's entry is on the EOS: stopping is judged with the answer it ends.
    tok = char_tokenizer(ALPHABET)
    completions = [
        "7+5+0=12;4+8+1=13>1",  # right steps, stops one digit into the answer
        "7+5+0=12;4+8+1=13>131",  # right steps, wrong answer
        "7+5+0=12;4+8+1=13>132",  # right
        "7+5+0=13;4+8+1=13>133",  # the ones step and the answer wrong
    ]
    prompts = ["47+85="] * len(completions)
    batch = _batch(tok, prompts, completions)
    scored = ProcessScorer()([WeightedReward("arithmetic_steps", step_reward, 1.0)], prompts, completions, {})
    rewards, ends = ProcessBaseline(4, 1e-4, tok).step_tensors(scored.steps, batch)
    advantages = process_advantages(rewards, ends, batch.loss_mask, 4)  # (4, T)
    eos = [len(c) for c in completions]  # each completion's EOS token
    assert advantages[0, eos[0]] < 0 and advantages[1, eos[1]] < 0  # a wrong answer's stop pays for it
    assert advantages[2, eos[2]] > 0  # a right one's is rewarded
    assert advantages[0, eos[0]] == advantages[1, eos[1]]  # stopping early earns what finishing wrongly does


@pytest.mark.learning
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
