"""Training on multi-turn rollouts: tool tokens out of the loss, environments in the rewards,
and TRL's documentation examples of `tools=` and `environment_factory=` run unchanged.

The masking test samples real multi-turn rollouts (a tiny model that calls `multiply`), finds
which tokens the model sampled from what the decoder returned (never from the Rollout's own
mask), and compares one engine step (two update epochs: the ratios move and clip) with the
plain GRPO and PPO of tests/train/test_loss_mask.py run over the sampled tokens only: the
loss, KL, entropy, clip fraction, counts, PPO's critic and GAE, and every gradient.
"""

import copy
import json

import pytest
import torch

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.rewards import WeightedReward
from grpo.rollout.tools import Toolbox
from grpo.train.loop import build_engine
from tests.rollout.test_tools import as_multiply, sampled_and_appended, spy_on
from tests.rollout.tool_models import (
    INCREMENT_PROMPT,
    MULTIPLY_PROMPT,
    DatasetIncrementEnv,
    IncrementEnv,
    async_add,
    counter_reward,
    multiply,
)
from tests.train import test_loss_mask
from tests.helpers import run_generator
from tests.helpers import BACKWARD, assert_close_scaled, assert_same_metrics
from tests.train.test_assembled_step import ADAM_EPS, BETA, LR, MAX_GRAD_NORM, nudge
from tests.train.test_loss_mask import run_engine

SCORES = [1.0, 0.25, -0.5, 2.0, 0.0, 0.5]


def fixed_scores(completions, **kwargs):
    return SCORES[: len(completions)]


def plain_values(critic, b):
    """V(q, o_<t) at every completion position, read off the backbone by hand."""
    t_len = b.completion_mask.shape[1]
    position_ids = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = critic.backbone(
        input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=position_ids
    ).last_hidden_state
    return critic.head(hidden[:, -t_len - 1 : -1]).squeeze(-1)


def tool_engine(tool_model, tmp_path, algorithm, group_size):
    """The engine on the tool model and a multi-turn rollout drawn by the run's generator's
    sampler (the step trains on it as drawn); the rollout with its loss mask rebuilt from what
    the decoder sampled."""
    c = config_from_dict(
        {
            "algorithm": algorithm,
            "model": tool_model,
            "output_dir": str(tmp_path / "run"),
            "data": {"path": "unused.jsonl"},
            "rewards": [{"function": fixed_scores}],
            "rollout": {
                "group_size": group_size,
                "prompts_per_step": len(SCORES) // group_size,
                "max_new_tokens": 120,
                "temperature": 1.0,
                "tools": [multiply, async_add],
            },
            "train": {
                "steps": 1,
                "lr": LR,
                "epochs": 2,
                "autocast": "off",
                "max_grad_norm": MAX_GRAD_NORM,
                "gradient_checkpointing": False,
            },
            "loss": {"beta": BETA},
        }
    )
    e = build_engine(c, [WeightedReward(name="fixed", fn=fixed_scores, weight=1.0)])
    sampler = run_generator(c, e, Toolbox.from_config(c.rollout)).samplers["train"]
    records = spy_on(sampler, e.policy)
    rows = [{"prompt": MULTIPLY_PROMPT}] * (len(SCORES) // group_size)
    rollout = sampler.sample(e.policy, rows, step=0, version=0)
    sampled = torch.zeros_like(rollout.loss_mask)
    for i in range(len(rollout)):
        mask = sampled_and_appended(rollout, records, sampler, i)
        sampled[i, : len(mask)] = mask
    # The policy is moved below: the sampler's log-probs are not its own any more.
    rollout.sampled_logprobs, rollout.logprobs_exact = None, False
    for group in e.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    reference = copy.deepcopy(e.policy).requires_grad_(False)
    trained = [e.policy, *e.critic.networks]
    for seed, model in enumerate(trained):
        nudge(model, seed)
    by_hand = rollout.select(torch.arange(len(rollout)))
    by_hand.loss_mask = sampled  # the reference's actions: the tokens the decoder returned, found by position
    return e, rollout, by_hand, reference, [copy.deepcopy(m) for m in trained]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, group_size", [("grpo", 3), ("ppo", 1)])
def test_the_step_on_multi_turn_rollouts_is_the_plain_one_over_the_sampled_tokens(
    tool_model, tmp_path, monkeypatch, algorithm, group_size
):
    monkeypatch.setattr(test_loss_mask, "plain_values", plain_values)
    e, rollout, by_hand, reference, models = tool_engine(tool_model, tmp_path, algorithm, group_size)
    # Tool tokens inside completions, with sampled tokens after them.
    inside = (rollout.completion_mask - by_hand.loss_mask).bool() & (
        by_hand.loss_mask.flip(1).cummax(1).values.flip(1) > 0
    )
    assert inside.any()
    metrics, seen = run_engine(e, rollout)
    scores = torch.tensor(SCORES)
    if algorithm == "grpo":
        want, grads = test_loss_mask.plain_grpo(models[0], reference, by_hand, scores, e.loss.aggregation, "token")
    else:
        want, grads = test_loss_mask.plain_ppo(*models, reference, by_hand, scores)
    assert_same_metrics(metrics, want)
    assert_close_scaled(seen, grads, BACKWARD)
    assert metrics["tokens/trained"] == int(by_hand.loss_mask.sum())
    assert metrics["tokens/completion"] == int(rollout.completion_mask.sum())
    tool_tokens = float((rollout.completion_mask - by_hand.loss_mask).sum())
    assert metrics["tools/mask_fraction"] == pytest.approx(tool_tokens / float(rollout.completion_mask.sum()))
    assert metrics["tools/calls_per_rollout"] == pytest.approx(float(rollout.tool_calls.mean()))


# ---- whole runs -------------------------------------------------------------------------------


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_config(tool_model, tmp_path, rows, **rollout):
    return {
        "model": tool_model,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": write_rows(tmp_path / "rows.jsonl", rows)},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 200, "temperature": 0.3, **rollout},
        "train": {"steps": 1, "lr": 1e-3, "sample_every": 1, "gradient_checkpointing": False},
    }


def correct(completions, **kwargs):
    """A TRL-style reward on the last message of a multi-turn completion."""
    return [float(c[-1]["content"] == "12") for c in completions]


@pytest.mark.parametrize("sampler", ["fast", "hf"])
def test_trl_s_tools_example_trains_unchanged(tool_model, tmp_path, sampler):
    """TRL's documentation: GRPOTrainer(tools=[multiply, async_add], ...)."""
    config = run_config(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2, sampler=sampler)
    config["rewards"] = [{"function": correct}]
    result = grpo.train(config, tools=[multiply, async_add], progress=False)
    (metrics,) = result.metrics
    assert metrics["tools/calls_per_rollout"] > 0 and metrics["reward/mean"] > 0
    assert 0 < metrics["tools/mask_fraction"] < 1 and metrics["tools/failures"] >= 0
    sample = json.loads((result.output_dir / "samples.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in sample["messages"]][:2] == ["assistant", "tool"]  # the whole conversation
    written = (result.output_dir / "config.yaml").read_text()
    assert "tests.rollout.tool_models:multiply" in written and "tests.rollout.tool_models:async_add" in written


def test_tools_named_by_spec_in_the_config(tool_model, tmp_path):
    config = run_config(
        tool_model,
        tmp_path,
        [{"prompt": MULTIPLY_PROMPT}] * 2,
        tools=["tests.rollout.tool_models:multiply", "tests.rollout.tool_models:async_add"],
        max_tool_calls=0,
    )
    config["rewards"] = [{"function": "tests.train.test_tools_training:correct"}]
    (metrics,) = grpo.train(config, progress=False).metrics
    assert metrics["tools/calls_per_rollout"] == 0 and metrics["tools/mask_fraction"] == 0  # no call is run


def test_trl_s_environment_example_trains_unchanged(tool_model, tmp_path):
    """TRL's documentation: GRPOTrainer(environment_factory=IncrementEnv), the environment
    owning the reward (get_reward) and reset returning the task, appended to the prompt."""
    config = run_config(tool_model, tmp_path, [{"prompt": [{"role": "user", "content": ""}]}] * 2)
    result = grpo.train(config, environment_factory=IncrementEnv, progress=False)
    (metrics,) = result.metrics
    assert "reward/tests.rollout.tool_models:IncrementEnv.get_reward" in metrics
    assert metrics["frac_unscored"] == 0


def test_trl_s_environment_example_trains_with_no_data(tool_model, tmp_path):
    """TRL's way without a dataset: the environment writes every prompt from reset (the
    prompts are empty user messages, a step's worth)."""
    config = run_config(tool_model, tmp_path, [])
    del config["data"]
    result = grpo.train(config, environment_factory=IncrementEnv, progress=False)
    (metrics,) = result.metrics
    assert metrics["frac_unscored"] == 0 and "reward/tests.rollout.tool_models:IncrementEnv.get_reward" in metrics
    samples = [json.loads(line) for line in (result.output_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and all(
        s["prompt"][-1]["content"].startswith("Increment the counter by ") for s in samples
    ), samples


@pytest.mark.parametrize(
    "environment, message",
    [
        (None, r"data.path: required \(a prompt file or a datasets name; or a rollout.environment whose reset"),
        ({"counter": DatasetIncrementEnv}, r"data.path: required with several environments"),
    ],
)
def test_no_data_needs_one_environment(tool_model, tmp_path, environment, message):
    config = run_config(tool_model, tmp_path, [], environment=environment, tools=[] if environment else [multiply])
    del config["data"]
    config["rewards"] = [{"function": correct}]
    with pytest.raises(UserError, match=rf"^{message}"):
        grpo.train(config, progress=False)


def test_a_reward_reads_the_environments(tool_model, tmp_path):
    """TRL's dataset-fed IncrementEnv: reset(target=...) from the row; a reward function that
    takes `environments` reads each rollout's counter, which the model's call moved."""
    rows = [{"prompt": INCREMENT_PROMPT, "target": 2}] * 2
    config = run_config(tool_model, tmp_path, rows)
    config["rewards"] = [{"function": counter_reward}]
    (metrics,) = grpo.train(config, environment_factory=DatasetIncrementEnv, progress=False).metrics
    assert metrics["tools/calls_per_rollout"] > 0
    # The model learned increment(step=2): the counters read 2, and get_reward says so.
    assert metrics["reward/tests.rollout.tool_models:counter_reward"] == pytest.approx(2.0)
    assert metrics["reward/tests.rollout.tool_models:DatasetIncrementEnv.get_reward"] == pytest.approx(1.0)


def test_a_run_with_several_environments_scores_each_row_by_its_own(tool_model, tmp_path):
    """rollout.environment as a mapping of names to specs (a YAML config's): each environment's
    get_reward scores the rows that name it, so every row is scored; config.yaml keeps the
    mapping."""
    rows = [
        {"prompt": INCREMENT_PROMPT, "target": 2, "environment": "counter"},
        {"prompt": MULTIPLY_PROMPT, "environment": "product"},
    ]
    several = {
        "counter": "tests.rollout.tool_models:DatasetIncrementEnv",
        "product": "tests.rollout.tool_models:MultiplyEnv",
    }
    config = run_config(tool_model, tmp_path, rows, environment=several)
    result = grpo.train(config, progress=False)
    (metrics,) = result.metrics
    assert metrics["frac_unscored"] == 0
    assert metrics["reward/counter:tests.rollout.tool_models:DatasetIncrementEnv.get_reward"] == pytest.approx(1.0)
    assert "reward/product:tests.rollout.tool_models:MultiplyEnv.get_reward" in metrics
    written = (result.output_dir / "config.yaml").read_text()
    assert "counter: tests.rollout.tool_models:DatasetIncrementEnv" in written


def test_a_row_naming_no_environment_stops_the_run_before_any_model_loads(tmp_path):
    rows = [{"prompt": INCREMENT_PROMPT, "environment": "counter"}, {"prompt": MULTIPLY_PROMPT}]
    config = run_config("no/such/model", tmp_path, rows, environment={"counter": DatasetIncrementEnv})
    with pytest.raises(UserError, match=r"^rollout.environment: row 1 has no 'environment' field"):
        grpo.train(config, progress=False)


SCORED_STEPS = []


def counted_counter_reward(environments, trainer_state, **kwargs):  # both by keyword, as TRL calls it
    SCORED_STEPS.append(trainer_state.global_step)
    return counter_reward(environments)


@pytest.mark.resume
def test_a_resumed_run_with_tools_matches_an_uninterrupted_one(tool_model, tmp_path):
    """Nothing of a tool or an environment is checkpointed: each rollout starts from reset,
    so a run resumed from step 2 computes steps 3 and 4 as the run that never stopped."""
    rows = [{"prompt": INCREMENT_PROMPT, "target": 2}] * 2 + [{"prompt": INCREMENT_PROMPT, "target": 3}] * 2
    keys = ("reward/mean", "loss", "kl", "tokens/completion", "tools/calls_per_rollout", "tools/mask_fraction")
    runs = {}
    for name, steps in (("straight", 4), ("stopped", 2), ("stopped", 4)):
        config = run_config(tool_model, tmp_path, rows, temperature=1.0)
        config["output_dir"] = str(tmp_path / name)
        config["train"].update(steps=steps, checkpoint_every=2)
        config["rewards"] = [{"function": counted_counter_reward}]
        resume = steps == 4 and name == "stopped"
        SCORED_STEPS.clear()
        result = grpo.train(config, environment_factory=DatasetIncrementEnv, progress=False, resume=resume)
        runs[name] = [{k: m[k] for k in keys} for m in result.metrics]
    assert SCORED_STEPS == [2, 3]  # the resumed run ran steps 3 and 4 only
    assert len(runs["stopped"]) == 4 and runs["stopped"] == runs["straight"]


@pytest.mark.torchrun
def test_two_processes_sample_and_train_as_one_with_a_seed_per_prompt(tool_model, tmp_path):
    """torchrun, 2 processes: each samples its prompts' multi-turn rollouts (its own
    environment instances), and with rollout.seed_per_prompt the run logs what 1 process
    logs, the tool metrics included (sums over both processes)."""
    from tests.train.test_distributed import metrics_of, torchrun, write_config

    rows = [{"prompt": INCREMENT_PROMPT, "target": t} for t in (2, 3, 2, 4)]
    configs = {}
    for name in ("one", "two"):
        config = run_config(tool_model, tmp_path, rows, prompts_per_step=4, temperature=1.0, seed_per_prompt=True)
        config["rollout"]["environment"] = "tests.rollout.tool_models:DatasetIncrementEnv"
        config["rewards"] = [{"function": "tests.rollout.tool_models:counter_reward"}]
        config["output_dir"] = str(tmp_path / name)
        config["train"].update(steps=2, device="cpu")
        configs[name] = config
    grpo.train(configs["one"], progress=False)
    run = torchrun("-m", "grpo", "train", str(write_config(tmp_path, "two", configs["two"])), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    for a, b in zip(metrics_of(tmp_path / "one"), metrics_of(tmp_path / "two"), strict=True):
        for key in (
            "reward/mean",
            "tokens/completion",
            "tools/calls_per_rollout",
            "tools/failures",
            "tools/mask_fraction",
        ):
            assert a[key] == b[key], key
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert metrics_of(tmp_path / "one")[0]["tools/calls_per_rollout"] > 0


def calculator_down(a: int, b: int) -> int:
    raise RuntimeError("the calculator is down")


def test_a_tool_that_always_fails_is_no_dead_run(tool_model, tmp_path):
    """Every call raises: the model gets the error as the tool's message, the run goes on,
    and tools/failures counts every call."""
    config = run_config(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2)
    config["rewards"] = [{"function": correct}]
    config["train"]["steps"] = 2
    result = grpo.train(config, tools=[as_multiply(calculator_down), async_add], progress=False)
    assert len(result.metrics) == 2 and (result.final_dir / "config.json").exists()
    calls = sum(m["tools/calls_per_rollout"] * 4 for m in result.metrics)  # 2 prompts x G=2 per step
    assert calls > 0 and sum(m["tools/failures"] for m in result.metrics) == pytest.approx(calls)
    sample = json.loads((result.output_dir / "samples.jsonl").read_text().splitlines()[0])
    assert "the calculator is down" in sample["messages"][1]["content"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "isolate, error",
    [(False, "the tool called os._exit(3)"), (True, "the tool ended its worker process (exit code 3)")],
)
def test_a_tool_that_ends_its_process_is_an_error_and_the_run_goes_on(tool_model, tmp_path, isolate, error):
    """Every call of the tool calls os._exit(3); `grpo train` in a process of its own (which
    such a tool used to end, silently, with exit code 3) trains its steps to the end: each
    call answered with the error, counted in tools/failures."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    config = run_config(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2, tool_isolate=isolate)
    config["rollout"]["tools"] = ["tests.rollout.tools_that_fail:exits", "tests.rollout.tool_models:async_add"]
    config["rewards"] = [{"function": "tests.train.test_tools_training:correct"}]
    config["train"]["steps"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "grpo", "train", str(path), "--quiet"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    calls = sum(m["tools/calls_per_rollout"] * 4 for m in metrics)  # 2 prompts x G=2 per step
    assert len(metrics) == 2 and calls > 0 and sum(m["tools/failures"] for m in metrics) == pytest.approx(calls)
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert json.loads(sample["messages"][1]["content"]) == {"error": error}


def test_plain_text_prompts_with_tools_stop_the_run_before_any_model_loads(tmp_path, monkeypatch):
    import grpo.train.loop as loop

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loop, "build_engine", no_model)
    config = run_config("no/such/model", tmp_path, [{"prompt": "What is 3 times 4?"}] * 2)
    config["rewards"] = [{"function": correct}]
    with pytest.raises(UserError, match="must be chat messages .*row 0 is") as err:
        grpo.train(config, tools=[multiply], progress=False)
    assert "\n" not in str(err.value)
