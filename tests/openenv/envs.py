"""OpenEnv environments written the OpenEnv way (pydantic Action and Observation types, an
`Environment` subclass, an MCP environment with FastMCP tools, `create_app` + uvicorn), for
tests/openenv.

- `EchoEnvironment`: TRL's echo example in spirit, on the action the tiny tool model knows
  (`increment(step)`, tests/rollout/tool_models.py): each step echoes the step back with the
  counter, and rewards the step's size (as the echo environment rewards a message's length).
- `GuessingGame`: an MCP environment with several tools (guess, hint, give_up): a number
  to guess in several turns; a right guess is done with reward 1.
- `serve(app)`: a server on 127.0.0.1 (an ephemeral port) in a thread of this process,
  stopped by its `stop()`.
"""

import socket
import threading
import time

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class IncrementAction(Action):
    """Increment the internal counter."""

    step: int = Field(description="Value to add to the counter.")


class EchoObservation(Observation):
    echoed: int = Field(default=0, description="The step received.")
    counter: int = Field(default=0, description="The counter after it.")


class EchoEnvironment(Environment[IncrementAction, EchoObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id)
        self.counter = 0
        return EchoObservation()

    def step(self, action: IncrementAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        self.counter += action.step
        return EchoObservation(echoed=action.step, counter=self.counter, reward=float(action.step))

    @property
    def state(self) -> State:
        return self._state


class GuessingGame(MCPEnvironment):
    """Guess a number from 1 to 9 (the row's `secret`, else 7): guess(number) says higher,
    lower or right (done, reward 1); hint() says whether it is even (reward -0.25);
    give_up() ends the episode (done, reward 0)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("guessing")
        self.secret, self.ended = 7, False

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the secret number.

            Args:
                number: A number from 1 to 9.
            """
            if number == self.secret:
                self.ended, self.last_reward = True, 1.0
                return "right"
            self.last_reward = 0.0
            return "higher" if number < self.secret else "lower"

        @mcp.tool
        def hint() -> str:
            """Whether the secret number is even."""
            self.last_reward = -0.25
            return "even" if self.secret % 2 == 0 else "odd"

        @mcp.tool
        def give_up() -> str:
            """End the game."""
            self.ended, self.last_reward = True, 0.0
            return f"it was {self.secret}"

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed=None, episode_id=None, secret=7, **kwargs) -> Observation:
        self.secret, self.ended, self.last_reward = int(secret), False, None
        self._state = State(episode_id=episode_id)
        return Observation(metadata={"rules": "guess a number from 1 to 9"})

    def step(self, action, timeout_s=None, **kwargs):
        return self._scored(super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action, timeout_s=None, **kwargs):  # the server's way
        return self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _scored(self, observation):
        if isinstance(observation, CallToolObservation):  # the game's outcome on the tool's observation
            observation.reward, observation.done = self.last_reward, self.ended
        return observation

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


def echo_app():
    return create_app(EchoEnvironment, IncrementAction, EchoObservation, max_concurrent_envs=64)


def game_app():
    return create_app(GuessingGame, CallToolAction, CallToolObservation, max_concurrent_envs=64)


class Served:
    """A uvicorn server of `app` on 127.0.0.1, an ephemeral port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", ws_ping_interval=None, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def save_echo_model(directory, steps=120, lr=3e-3, seed=0):
    """A tiny Llama taught (`grpo sft`) on two conversations: one calls the echo environment's
    tool (its schema as the prompt shows it here, from the action type) with a step of 2 and
    says it is done, the other says it is done without the call: it calls about half the time."""
    import json
    from pathlib import Path

    from grpo.rollout.tools import Toolbox
    from grpo.tasks.tiny import tiny_llama, tool_chat_tokenizer
    from grpo.train.sft import FineTuneConfig, sft
    from tests.rollout.tool_models import INCREMENT_PROMPT, call

    directory = Path(directory)
    base, data = directory / "base", directory / "conversations.jsonl"
    tokenizer = tool_chat_tokenizer()
    tiny_llama(tokenizer, hidden_size=64, layers=2, heads=4, max_positions=2048, seed=seed).save_pretrained(base)
    tokenizer.save_pretrained(base)
    schemas = Toolbox(environment=EchoEnvironment).schemas
    called = [
        *INCREMENT_PROMPT,
        call("increment", step=2),
        {"role": "tool", "name": "increment", "content": json.dumps({"echoed": 2, "counter": 2})},
        {"role": "assistant", "content": "Done."},
    ]
    rows = [
        {"messages": m, "tools": schemas}
        for m in (called, [*INCREMENT_PROMPT, {"role": "assistant", "content": "Done."}])
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = FineTuneConfig(
        model=str(base), data=str(data), steps=steps, batch_size=2, lr=lr, warmup_steps=0, max_grad_norm=0.0
    )
    sft(directory / "model", config, progress=False, device="cpu")
    return directory / "model"
