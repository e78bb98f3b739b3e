"""OpenEnv environments as rollout.environment (grpo.rollout.openenv), with openenv itself:
in this process (an Environment class) and behind a server (create_app + uvicorn on
127.0.0.1, OpenEnv's stock client).

- The tools come from the action schema (its fields but metadata) or an MCP tool list; a
  tool's answer is the observation as text; the episode's reward is the environment's (the
  last observation's, or the sum); done ends the episode; one instance or session per rollout.
- The echo-style environment trains a tiny model whose reward rises, in this process and
  behind a server; the guessing game (MCP tools) runs episodes of several turns.
- A server gone mid-run stops it in one line, the last completed step saved.
"""

import json

import pytest
import torch

import grpo
from grpo.errors import UserError
from grpo.rollout.sampler import Sampler
from grpo.rollout.tools import Call, Toolbox
from grpo.tasks.tiny import tiny_llama, tool_chat_tokenizer
from tests.openenv.envs import (
    EchoEnvironment,
    GuessingGame,
    IncrementAction,
    Served,
    echo_app,
    game_app,
    save_echo_model,
)
from tests.rollout.test_tools import Scripted
from tests.rollout.tool_models import INCREMENT_PROMPT

pytestmark = pytest.mark.openenv


@pytest.fixture(scope="module")
def echo_server():
    served = Served(echo_app())
    yield served
    served.stop()


@pytest.fixture(scope="module")
def game_server():
    served = Served(game_app())
    yield served
    served.stop()


@pytest.fixture(params=["class", "server"])
def echo(request):
    """The echo environment as rollout.environment: its class, or its server's URL."""
    return EchoEnvironment if request.param == "class" else request.getfixturevalue("echo_server").url


def test_the_tool_is_the_action_s_fields_but_metadata(echo):
    (schema,) = Toolbox(environment=echo).schemas
    function = schema["function"]
    assert function["name"] == "increment" and function["description"] == "Increment the internal counter."
    assert function["parameters"]["properties"] == {
        "step": {"type": "integer", "description": "Value to add to the counter."}
    }
    assert function["parameters"]["required"] == ["step"]
    assert "metadata" in IncrementAction.model_json_schema()["properties"]  # every Action has it: no parameter


@pytest.mark.parametrize("reward, expected", [("last", 3.0), ("sum", 5.0)])
def test_an_episode_steps_its_own_instance_and_scores_the_environment_s_reward(echo, reward, expected):
    box = Toolbox(environment=echo, environment_reward=reward)
    episodes, texts = box.start([{"prompt": INCREMENT_PROMPT}] * 2)
    assert texts == [None, None]  # the reset observation is empty: nothing added to the prompt
    first, second = episodes
    assert json.loads(first.run(Call("increment", {"step": 2}))["content"]) == {"echoed": 2, "counter": 2}
    assert json.loads(first.run(Call("increment", {"step": 3}))["content"]) == {"echoed": 3, "counter": 5}
    assert json.loads(second.run(Call("increment", {"step": 1}))["content"]) == {"echoed": 1, "counter": 1}
    bad = first.run(Call("increment", {"step": 1, "metadata": {}}))  # no parameter of the tool
    assert "metadata" in json.loads(bad["content"])["error"] and first.failures == 1
    (get_reward,) = box.rewards()
    assert get_reward.fn([e.environment for e in episodes]) == [expected, 1.0]


class Turns(Scripted):
    """A decoder that writes the given turns, one a decoding call (the last one again after)."""

    def __init__(self, tokenizer, turns):
        self.turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in turns]
        self.calls = 0

    def decode(self, prompt_ids, prompt_mask, counts, generators, params=None):
        out = self.turns[min(self.calls, len(self.turns) - 1)][: params.max_new_tokens]
        self.calls += 1
        return torch.tensor([out] * int(counts.sum())), None


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def chat_lm():
    """An untrained tiny model with the tool chat template: the turns are scripted (`Turns`)."""
    tokenizer = tool_chat_tokenizer()
    return tokenizer, tiny_llama(tokenizer, hidden_size=32, layers=1, heads=2, max_positions=2048, seed=0).eval()


@pytest.mark.parametrize("where", ["class", "server"])
@pytest.mark.parametrize("reward, expected", [("last", 1.0), ("sum", 0.75)])
def test_the_guessing_game_plays_several_turns_until_done(chat_lm, request, where, reward, expected):
    """An MCP environment's tools (guess, hint, give_up); the episode ends at the right
    guess: the model's next turn is sampled, its call is not run."""
    tokenizer, model = chat_lm
    game = GuessingGame if where == "class" else request.getfixturevalue("game_server").url
    box = Toolbox(environment=game, environment_reward=reward, timeout=30.0)
    assert sorted(s["function"]["name"] for s in box.schemas) == ["give_up", "guess", "hint"]
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=1, max_new_tokens=1000, backend="fast", tools=box)
    turns = [call("hint"), call("guess", number=5), call("guess", number=7), call("give_up")]
    sampler.decoders["fast"] = Turns(tokenizer, turns)
    rollout = sampler.sample(model, [{"prompt": [{"role": "user", "content": "Guess."}], "secret": 7}])
    messages = rollout.messages[0]
    assert [m["role"] for m in messages] == ["assistant", "tool"] * 3 + ["assistant"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == ["odd", "higher", "right"]
    assert rollout.tool_calls.tolist() == [3.0]
    (get_reward,) = box.rewards()
    assert get_reward.fn(rollout.environments) == [expected]


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    return str(save_echo_model(tmp_path_factory.mktemp("echo_model")))


def mean(values):
    return sum(values) / len(values)


@pytest.mark.learning
def test_the_echo_environment_trains_a_tiny_model_whose_reward_rises(echo_model, echo, tmp_path):
    """TRL's echo example in spirit: the environment's reward (the step echoed) is the only
    reward, in this process and behind a server. The base calls the tool about half the time
    (answers 'Done.' without it otherwise); GRPO raises the calls and so the reward."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": INCREMENT_PROMPT}) + "\n")
    config = {
        "model": echo_model,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(rows)},
        "rollout": {"group_size": 16, "prompts_per_step": 1, "max_new_tokens": 64, "temperature": 0.7},
        "train": {"steps": 8, "lr": 1e-4, "gradient_checkpointing": False, "sample_every": 0},
        "loss": {"beta": 0.0},
    }
    result = grpo.train(config, environment_factory=echo, progress=False)
    for metrics in result.metrics:
        (key,) = [k for k in metrics if k.startswith("reward/") and k.endswith(".get_reward")]
        assert metrics["frac_unscored"] == 0 and metrics["reward/mean"] == metrics[key]
    rewards = [m["reward/mean"] for m in result.metrics]
    # A call echoes a step of 2: rewards lie in [0, 2]; the base's first steps about 0.8.
    assert mean(rewards[-4:]) > mean(rewards[:2]) + 0.3, rewards


SERVER = {}


def stop_the_server(completions, **kwargs):
    """A reward of 0 that stops the server after the first step's rollouts."""
    SERVER.pop("served").stop()
    return [0.0] * len(completions)


@pytest.mark.resume
def test_a_server_gone_mid_run_is_one_line_and_the_step_is_saved(echo_model, tmp_path):
    SERVER["served"] = served = Served(echo_app())
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": INCREMENT_PROMPT}) + "\n")
    config = {
        "model": echo_model,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(rows)},
        "rewards": [{"function": stop_the_server}],
        "rollout": {"group_size": 2, "prompts_per_step": 1, "max_new_tokens": 60, "environment": served.url},
        "train": {"steps": 3, "gradient_checkpointing": False},
    }
    with pytest.raises(UserError) as raised:
        grpo.train(config, progress=False)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"environment {served.url!r}: the server stopped answering")
    assert "checkpoint of step 1 saved" in message, message
    assert (tmp_path / "run" / "checkpoints").is_dir() or any((tmp_path / "run").glob("**/step-000001"))
