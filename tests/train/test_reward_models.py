"""Reward models in the loop: GRPO keeps the reward model (it drops only the critic)."""

import pytest
import json

import torch

import grpo
from grpo.rewards.adapters import ModelReward, ProcessModelReward, step_ends
from grpo.rewards.model import RewardModel
from grpo.train.networks import FrozenCopy
from tests.helpers import assert_close_scaled


@pytest.mark.learning
def test_grpo_driven_only_by_a_reward_model_raises_its_reward(make_config, sevens_rm):
    rm_dir, _ = sevens_rm
    config = make_config(
        rewards=[{"model": rm_dir}, {"function": "tests.train.rewards_for_tests:sevens", "weight": 0.0}],
        train={"steps": 40, "lr": 1e-3},
    )
    result = grpo.train(config, progress=False)
    assert result.models_held == 3  # policy, reference, reward model
    learned = [m[f"reward/model:{rm_dir}"] for m in result.metrics]
    truth = [m["reward/tests.train.rewards_for_tests:sevens"] for m in result.metrics]  # weight 0: watched only
    assert sum(learned[-5:]) / 5 - sum(learned[:5]) / 5 >= 1.0, [round(x, 2) for x in learned]
    assert sum(truth[-5:]) / 5 - sum(truth[:5]) / 5 >= 0.2  # the reward model was not hacked here


def test_iterative_rl_retrains_the_reward_model_with_replay(make_config, sevens_rm, monkeypatch):
    rm_dir, history = sevens_rm
    resets, fits = [], []
    real_reset, real_fit = FrozenCopy.reset_to, RewardModel.fit

    def reset_to(self, policy):
        real_reset(self, policy)
        state, reference = policy.state_dict(), self.model.state_dict()
        resets.append(all(torch.equal(state[k], reference[k]) for k in state))

    def fit(self, pairs, **kwargs):
        fits.append(len(pairs))
        return real_fit(self, pairs, **kwargs)

    monkeypatch.setattr(FrozenCopy, "reset_to", reset_to)
    monkeypatch.setattr(RewardModel, "fit", fit)
    config = make_config(
        rewards=[{"model": rm_dir}],
        train={"steps": 6, "iterations": 3, "lr": 1e-3},
        reward_model_update={
            "verifier": "tests.train.rewards_for_tests:sevens",
            "data": history,
            "prompts": 4,
            "samples_per_prompt": 4,
            "replay": 0.1,
            "lr": 1e-3,
        },
    )
    result = grpo.train(config, progress=False)
    assert resets == [True, True]  # at the start of iterations 2 and 3, reference <- policy

    updates = [json.loads(line) for line in (result.output_dir / "reward_model_updates.jsonl").read_text().splitlines()]
    assert [u["before_step"] for u in updates] == [3, 5]
    assert updates[0]["history"] == 40 and updates[0]["replayed"] == 4  # 10% of 40 earlier pairs
    assert updates[1]["history"] == 40 + updates[0]["new_pairs"]
    assert updates[1]["replayed"] == round(0.1 * updates[1]["history"])
    assert all(u["new_pairs"] > 0 for u in updates)
    assert fits == [u["new_pairs"] + u["replayed"] for u in updates]

    before = RewardModel.from_pretrained(rm_dir).model.state_dict()
    after = RewardModel.from_pretrained(str(result.output_dir / "reward_model")).model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_normalised_model_scores_are_standardised(sevens_rm):
    rm = RewardModel.from_pretrained(sevens_rm[0])
    completions = ["7777", "1234", "7a7b", "cccc", "77"]
    raw = torch.tensor(ModelReward(rm)(["a"] * 5, completions))
    got = torch.tensor(ModelReward(rm, normalize=True)(["a"] * 5, completions))
    torch.testing.assert_close(got, (raw - raw.mean()) / raw.std(), rtol=1e-4, atol=1e-4)


def test_process_reward_model_scores_each_step_prefix(sevens_rm):
    rm = RewardModel.from_pretrained(sevens_rm[0])
    assert step_ends("12a45a6", "a") == [3, 6, 7]
    assert step_ends("12a", "a") == [3] and step_ends("", "a") == []
    steps = ProcessModelReward(rm, separator="a")(["b", "b"], ["12a45a6", "7a"])
    assert [end for end, _ in steps[0]] == [3, 6, 7] and [end for end, _ in steps[1]] == [2]
    want = rm.scores(["b"] * 3, ["12a", "12a45a", "12a45a6"])
    assert_close_scaled(torch.tensor([s for _, s in steps[0]]), want)


def test_grpo_with_a_process_reward_model_runs(make_config, sevens_rm):
    config = make_config(
        rewards=[{"model": sevens_rm[0], "process": True, "step_separator": "a"}],
        loss={"supervision": "process"},
        train={"steps": 2},
    )
    metrics = grpo.train(config, progress=False).metrics
    assert len(metrics) == 2 and all(m["reward/mean"] is not None for m in metrics)


def test_a_process_with_no_prompt_of_an_update_takes_a_rollout_of_no_rows(make_config, sevens_rm):
    """Under torchrun an update's prompts are split over the processes, and one may get none
    (fewer prompts than processes); it still takes its batch (sampling gathers a sharded
    policy, a collective), of no rows."""
    from grpo.config import config_from_dict
    from grpo.rollout.generator import PAIRS
    from grpo.train.loop import build_engine
    from tests.helpers import run_generator

    c = config_from_dict(
        make_config(
            rewards=[{"model": sevens_rm[0]}],
            train={"iterations": 2},
            reward_model_update={"verifier": "tests.train.rewards_for_tests:sevens"},
        )
    )
    e = build_engine(c, [], torch.device("cpu"))
    generator = run_generator(c, e)
    generator.request(1, [], None, PAIRS)
    batch = generator.take(1, PAIRS)
    assert len(batch) == 0 and batch.rows == [] and batch.completions == [] and batch.group_size == 4
