"""Tools and environments written the way TRL's GRPOTrainer documentation writes them, and a
tiny model taught to call them.

`multiply` and `async_add` are the documentation's tools example; `IncrementEnv` its
environment examples (one whose reset samples the task and returns it, one that reads the
task from the dataset's `target` column). They are used unchanged: type hints, Google-style
docstrings, sync and async.

`save_tool_model` saves a tiny Llama with a character tokenizer whose chat template speaks the
Qwen2.5/Hermes tool-call format (`grpo.tasks.tiny.tool_chat_tokenizer`), after `grpo sft` on a
conversation for each (tool calls and tool messages in them): the model then calls the tool at
its first turn and answers after the tool's message, so that multi-turn rollouts do happen.
"""

import json
import random
from pathlib import Path

from grpo.tasks.tiny import tiny_llama, tool_chat_tokenizer

# ---- as TRL's documentation writes them -------------------------------------------------------


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class DatasetIncrementEnv(IncrementEnv):
    """The documentation's second IncrementEnv: the task from the dataset's `target` column
    (its increment is the first one's, docstring included)."""

    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target


class MultiplyEnv:
    """A second environment, for a run of several (TRL's environment_factory as a mapping): its
    one tool multiplies; it scores a rollout 1 when the model called it, and keeps the
    columns its reset got."""

    def reset(self, **kwargs) -> None:
        self.calls, self.columns = 0, sorted(kwargs)

    def get_reward(self) -> float:
        return float(self.calls > 0)

    def multiply(self, a: int, b: int) -> int:
        self.calls += 1
        return a * b


MultiplyEnv.multiply.__doc__ = multiply.__doc__  # the schema the tiny model learned with


def counter_reward(environments, **kwargs):
    """A reward that reads the environments (TRL passes `environments=` when there are any)."""
    return [float(env.counter) for env in environments]


# ---- the conversations the tiny model learns ---------------------------------------------------


def user(text):
    return [{"role": "user", "content": text}]


def call(name, **arguments):
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


MULTIPLY_PROMPT = user("What is 3 times 4?")
INCREMENT_PROMPT = user("Increment the counter to 2.")
CONVERSATIONS = [
    # (tools shown in the prompt, the conversation)
    (
        [multiply, async_add],
        [
            *MULTIPLY_PROMPT,
            call("multiply", a=3, b=4),
            {"role": "tool", "name": "multiply", "content": "12"},
            {"role": "assistant", "content": "12"},
        ],
    ),
    (
        [DatasetIncrementEnv().increment],
        [
            *INCREMENT_PROMPT,
            call("increment", step=2),
            {"role": "tool", "name": "increment", "content": "2"},
            {"role": "assistant", "content": "Done."},
        ],
    ),
]


def tool_conversations() -> list[dict]:
    """The conversations as `grpo sft` rows: their messages, and the JSON schemas of the
    tools their prompt shows (TRL's `tools` column)."""
    from transformers.utils import get_json_schema

    return [
        {"messages": conversation, "tools": [get_json_schema(t) for t in tools]}
        for tools, conversation in CONVERSATIONS
    ]


def save_tool_model(directory, steps=150, lr=3e-3, seed=0, hidden_size=64, heads=4) -> Path:
    """Teach a tiny model the conversations with `grpo sft` (every assistant turn learned,
    its tool calls included; the tool messages are context) and save it with its tokenizer
    (vLLM's CPU attention wants heads of 64: hidden_size=128, heads=2)."""
    from grpo.train.sft import FineTuneConfig, sft

    directory = Path(directory)
    base, data = directory / "base", directory / "conversations.jsonl"
    tokenizer = tool_chat_tokenizer()
    tiny_llama(
        tokenizer, hidden_size=hidden_size, layers=2, heads=heads, max_positions=2048, seed=seed
    ).save_pretrained(base)
    tokenizer.save_pretrained(base)
    data.write_text("".join(json.dumps(row) + "\n" for row in tool_conversations()))
    config = FineTuneConfig(
        model=str(base),
        data=str(data),
        steps=steps,
        batch_size=len(CONVERSATIONS),
        lr=lr,
        warmup_steps=0,
        max_grad_norm=0.0,
    )
    model = directory / "model"
    sft(model, config, progress=False, device="cpu")
    return model
