"""grpo.rollout.openenv without openenv: an action's tool, an observation's text, an
episode's reward (last or sum), done, and a server gone mid-episode stopping the turn
instead of answering the call (tests/openenv runs the real thing in .venv-openenv)."""

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field

from grpo.rollout import openenv
from grpo.rollout.tools import Call, Episode, Lost, answer_turn


class Action(BaseModel):  # OpenEnv's Action, as it is: every action has metadata
    model_config = ConfigDict(extra="forbid")
    metadata: dict = Field(default_factory=dict, description="Additional metadata for the action")


class GuessNumberAction(Action):
    """Guess the secret number.

    More text that the prompt does not need."""

    number: int = Field(description="A number from 1 to 9.")
    loud: bool = False


def test_an_action_s_tool_is_its_fields_but_metadata():
    tool = openenv.tool_of_action(GuessNumberAction)
    function = tool.schema["function"]
    assert function["name"] == "guess_number" and function["description"] == "Guess the secret number."
    assert function["parameters"] == {
        "type": "object",
        "properties": {
            "number": {"type": "integer", "description": "A number from 1 to 9."},
            "loud": {"type": "boolean", "default": False},
        },
        "required": ["number"],
    }
    assert list(function["parameters"]["properties"]["number"]) == ["type", "description"]  # get_json_schema's order


@pytest.mark.parametrize(
    "fields, text",
    [
        ({"echoed_message": "hi"}, "hi"),
        ({"counter": 3}, "3"),
        ({"echoed_message": "hi", "message_length": 2}, '{"echoed_message": "hi", "message_length": 2}'),
    ],
)
def test_an_observation_s_fields_are_the_tool_s_answer(fields, text):
    assert openenv._text(fields) == text


def test_a_reset_s_empty_fields_add_nothing_to_the_prompt():
    assert openenv._text({"echoed_message": "", "message_length": 0}, drop_empty=True) is None
    assert openenv._text({"board": "..X", "moves": 0}, drop_empty=True) == "..X"


class Session:
    """A stand-in server session: each step's (reward, done), or an error to raise."""

    def __init__(self, steps):
        self.steps, self.closed = list(steps), False

    def reset(self, row):
        return openenv.Step({"board": row.get("board", "")}, None, False)

    def step(self, payload):
        reward, done = self.steps.pop(0)
        if isinstance(reward, BaseException):
            raise reward
        return openenv.Step({"number": payload.number}, reward, done)

    def close(self):
        self.closed = True


def episode_class(steps, reward="last", remote=False):
    tools = [openenv.tool_of_action(GuessNumberAction)]
    return openenv._episode_class("tests:Game", lambda: Session(steps), tools, reward, remote)


@pytest.mark.parametrize("mode, expected", [("last", 1.0), ("sum", 0.5)])
def test_the_episode_s_reward_is_the_last_observation_s_or_the_sum(mode, expected):
    env = episode_class([(-0.5, False), (None, False), (1.0, True)], mode)()
    assert env.reset(board="...") == "..."
    episode = Episode({"guess_number": env.guess_number}, env)
    for number in (1, 2, 3):
        assert episode.run(Call("guess_number", {"number": number}))["content"] == str(number)
    assert env.rewards == [-0.5, 1.0] and env.done and episode.done
    assert env.get_reward() == expected


def test_done_ends_the_episode_and_metadata_is_no_parameter():
    env = episode_class([(1.0, True)])()
    env.reset()
    episode = Episode({"guess_number": env.guess_number}, env)
    answer = episode.run(Call("guess_number", {"number": 1, "metadata": {}}))
    assert "metadata" in json.loads(answer["content"])["error"]
    assert not episode.done and episode.run(Call("guess_number", {"number": 7}))["content"] == "7"
    assert episode.done  # the Toolbox runs no further call; a call in the same turn is refused
    assert "the episode is over" in json.loads(episode.run(Call("guess_number", {"number": 7}))["content"])["error"]


def test_a_server_gone_mid_episode_stops_the_turn_in_one_line():
    env = episode_class([(0.0, False), (ConnectionResetError("connection reset by peer"), False)], remote=True)()
    env.reset()
    episode = Episode({"guess_number": env.guess_number}, env, timeout=5.0)
    episode.run(Call("guess_number", {"number": 1}))
    with pytest.raises(Lost, match=r"^environment 'tests:Game': the server stopped answering during a guess_number"):
        answer_turn([(episode, [Call("guess_number", {"number": 2})])])


def test_an_environment_s_own_error_is_the_tool_s_answer():
    env = episode_class([(ValueError("not a move"), False)], remote=True)()
    env.reset()
    answer = Episode({"guess_number": env.guess_number}, env).run(Call("guess_number", {"number": 1}))
    assert "not a move" in json.loads(answer["content"])["error"]


def test_an_episode_crosses_a_process_as_its_outcome():
    import pickle

    env = episode_class([(0.25, False)])()
    env.reset()
    env.guess_number(number=3)
    copy = pickle.loads(pickle.dumps(env))
    assert isinstance(copy, openenv.Ended) and copy.get_reward() == 0.25 and copy.rewards == [0.25]
