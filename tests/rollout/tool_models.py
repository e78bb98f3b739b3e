"""Tools and environments written the way TRL's GRPOTrainer documentation writes them, and a
tiny model taught to call them.

`multiply` and `async_add` are the documentation's tools example; `IncrementEnv` its
environment examples (one whose reset samples the task and returns it, one that reads the
task from the dataset's `target` column). They are used unchanged: type hints, Google-style
docstrings, sync and async.

`tool_model` saves a tiny Llama with a character tokenizer whose chat template speaks the
Qwen2.5/Hermes tool-call format (`grpo.tasks.tiny.tool_chat_tokenizer`), after a few hundred
steps of teacher forcing on a conversation for each: the model then calls the tool at
its first turn and answers after the tool's message, so that multi-turn rollouts do happen.
"""

import random
from pathlib import Path

import torch

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


def _examples(tokenizer):
    """(ids, first trained position) per conversation: the loss is on what follows the prompt."""
    examples = []
    for tools, conversation in CONVERSATIONS:
        prompt = tokenizer.apply_chat_template(
            conversation[:1], tools=tools, add_generation_prompt=True, tokenize=False
        )
        whole = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)
        ids = tokenizer(whole, add_special_tokens=True)["input_ids"]
        examples.append((torch.tensor(ids), len(tokenizer(prompt, add_special_tokens=True)["input_ids"])))
    return examples


def save_tool_model(directory, steps=150, lr=3e-3, seed=0, hidden_size=64, heads=4) -> Path:
    """Teach a tiny model the conversations (teacher forcing on the turns after the prompt)
    and save it with its tokenizer (vLLM's CPU attention wants heads of 64: hidden_size=128, heads=2)."""
    directory = Path(directory)
    tokenizer = tool_chat_tokenizer()
    model = tiny_llama(tokenizer, hidden_size=hidden_size, layers=2, heads=heads, max_positions=2048, seed=seed)
    examples = _examples(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = 0.0
        for ids, start in examples:
            logits = model(input_ids=ids.unsqueeze(0)).logits[0, start - 1 : -1]
            loss = loss + torch.nn.functional.cross_entropy(logits.float(), ids[start:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
