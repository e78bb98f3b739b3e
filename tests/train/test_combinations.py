"""What the one Generator makes possible: features that used to refuse each other, together.

Every run's batches come from one generator built by one builder (grpo.rollout.generator),
in this process or, with rollout.async, in a worker process: tools, environments, LoRA and
iterative RL reach the worker the way they reach the in-process sampler.
"""

import json

import pytest
from transformers import AutoModelForCausalLM

import grpo
from grpo.rewards.model import RewardModel
from tests.helpers import the_reward_model_update
from tests.rollout.tool_models import INCREMENT_PROMPT, MULTIPLY_PROMPT, DatasetIncrementEnv, async_add, multiply
from tests.train import varying_tools
from tests.train.test_learning import gain

ASYNC = {"max_staleness": 1}


def tool_run(tool_model, tmp_path, rows, steps=1, **rollout):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model": tool_model,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(data)},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 200, "temperature": 0.3, **rollout},
        "train": {"steps": steps, "lr": 1e-3, "sample_every": 1, "gradient_checkpointing": False},
    }


def correct(completions, **kwargs):
    """A TRL-style reward on the last message of a multi-turn completion."""
    return [float(c[-1]["content"] == "12") for c in completions]


def counter_reward(environments, **kwargs):
    return [float(env.counter) for env in environments]


@pytest.mark.slow
def test_async_rollouts_call_the_tools_given_from_python(tool_model, tmp_path):
    """TRL's tools example with rollout.async: the worker builds the toolbox from the
    functions' specs and its rollouts are multi-turn, scored on their messages."""
    config = tool_run(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2, steps=2, **{"async": ASYNC})
    config["rewards"] = [{"function": correct}]
    result = grpo.train(config, tools=[multiply, async_add], progress=False)
    first, second = result.metrics
    assert first["tools/calls_per_rollout"] > 0 and first["reward/mean"] > 0
    assert 0 < first["tools/mask_fraction"] < 1
    assert (first["async/staleness"], second["async/staleness"]) == (0, 1)
    sample = json.loads((result.output_dir / "samples.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in sample["messages"]][:2] == ["assistant", "tool"]


@pytest.mark.slow
def test_async_rollouts_bring_their_environments_back_to_the_rewards(tool_model, tmp_path):
    """The dataset-fed IncrementEnv with rollout.async: the instances the worker's rollouts
    moved reach the trainer's rewards (a reward function reading `environments`, and the
    environment's own get_reward) as they do in a synchronous run."""
    rows = [{"prompt": INCREMENT_PROMPT, "target": 2}] * 2
    config = tool_run(tool_model, tmp_path, rows, **{"async": ASYNC})
    config["rewards"] = [{"function": counter_reward}]
    (metrics,) = grpo.train(config, environment_factory=DatasetIncrementEnv, progress=False).metrics
    assert metrics["tools/calls_per_rollout"] > 0
    assert metrics["reward/tests.train.test_combinations:counter_reward"] == pytest.approx(2.0)
    assert metrics["reward/tests.rollout.tool_models:DatasetIncrementEnv.get_reward"] == pytest.approx(1.0)


@pytest.mark.learning
def test_async_with_lora_learns_the_sevens_reward(make_config):
    """LoRA with rollout.async: the worker samples with the merged weights (a plain model),
    the trainer's ratio anchors at the sampler's log-probs; the reward goes up."""
    config = make_config(train={"steps": 40, "lr": 1e-2, "sample_every": 0}, lora={"r": 16, "alpha": 64})
    config["rollout"]["async"] = ASYNC
    result = grpo.train(config, progress=False)
    m = result.metrics
    # LoRA on this tiny model learns slower than a full fine-tune (a synchronous run gains as
    # much); a worker that never got the adapters' deltas samples the base throughout.
    rewards = [round(x["reward/mean"], 3) for x in m]
    assert gain(m) >= 0.08 and sum(rewards[-5:]) / 5 >= 0.15, rewards
    assert [x["async/staleness"] for x in m] == [0] + [1] * 39 and result.summary["async"]["dropped"] == 0
    final = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not any("lora" in k for k in final.state_dict())


TOOL_ANSWERS_SCORED: list[int] = []  # per verifier call: how many completions hold a tool's answer


def sevens_in_messages(prompts, completions, **kwargs):
    """The verifier of iterative RL on multi-turn rollouts: a score from the messages (which
    must be messages: a string's characters have no .get), the tool's included."""
    TOOL_ANSWERS_SCORED.append(sum(any(m.get("role") == "tool" for m in c) for c in completions))
    return [float(sum(len(str(m.get("content", ""))) for m in c)) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_iterative_rl_with_tools_trains_the_reward_model_on_multi_turn_samples(tool_model, tmp_path, mode):
    """Iterative RL with tools: the reward model's new comparisons are the policy's multi-turn
    samples (with the tool's answers in them), drawn by the run's generator (a worker
    process with rollout.async), and the reward model moves."""
    rm_dir = tmp_path / "rm"
    RewardModel.from_base(tool_model, seed=0).save(rm_dir)
    rollout = {"group_size": 4, "async": ASYNC} if mode == "async" else {"group_size": 4}
    config = tool_run(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2, steps=2, **rollout)
    config["rewards"] = [{"model": str(rm_dir)}]
    config["train"].update(iterations=2, lr=1e-6)  # what is under test is the reward model's update
    config["reward_model_update"] = {
        "verifier": "tests.train.test_combinations:sevens_in_messages",
        "prompts": 2,
        "samples_per_prompt": 4,
        "save": True,
    }
    TOOL_ANSWERS_SCORED.clear()
    # The tool model answers each prompt the same way: a tool whose answers vary makes samples
    # that differ, hence comparisons (a planted worker without the toolbox scores none here).
    result = grpo.train(config, tools=[varying_tools.multiply, async_add], progress=False)
    assert sum(TOOL_ANSWERS_SCORED) > 0, f"the comparisons were sampled without the tools: {TOOL_ANSWERS_SCORED}"
    assert the_reward_model_update(result.output_dir, rm_dir)["new_pairs"] > 0
