"""The built-in multi-turn task: multiplication with a `multiply(a, b)` tool.

A tiny model cannot multiply two 2-digit numbers in its head; with the tool it only has to
copy the operands into a call and the tool's answer into its own. So the task shows at toy
scale what RL does with tools: a warmed-up model that calls the tool only some of the time
learns, from the outcome reward alone, to call it and answer with its result. The turns are
`chat_tokenizer`'s compact ChatML template in the Hermes tool-call format (`CHAT_TEMPLATE`).
Rows `make_rows`, verifier `correctness_reward`, votes `extract_answer`, warm-up rows
`conversations`; `task` registers it as a user's task would be ("grpo.tasks.multiply:task",
built-in "multiply"). docs/tools.md shows it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo.errors import UserError
from grpo.tasks.base import Task

__all__ = [
    "CHAT_TEMPLATE",
    "chat_tokenizer",
    "conversations",
    "correctness_reward",
    "extract_answer",
    "make_rows",
    "multiply",
    "parse_prompt",
    "save_base",
    "task",
    "tool_use",
]

MAX_DIGITS = 6
_PROMPT = re.compile(rf"([0-9]{{1,{MAX_DIGITS}}})\*([0-9]{{1,{MAX_DIGITS}}})")
_ANSWER = re.compile(r"[0-9]+")


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


# ---- rows and the verifier -------------------------------------------------------------------


def _prompt(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"{a}*{b}"}]


def _operands(rng: random.Random, digits: int) -> tuple[int, int]:
    if not 1 <= digits <= MAX_DIGITS:
        raise UserError(f"multiply: digits must be between 1 and {MAX_DIGITS}, got {digits}")
    low, high = 10 ** (digits - 1), 10**digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def make_rows(n: int, *, seed: int, digits: int = 2) -> list[dict]:
    """`n` rows {"prompt": chat messages, "answer": the product}; the same for the same seed
    (a private `random.Random(seed)`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = _operands(rng, digits)
        rows.append({"prompt": _prompt(a, b), "answer": str(a * b)})
    return rows


def _text(value: Any) -> str:
    """A prompt's or message's text: a string as it is, a message list's last content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content") or "")
    return str(value)


def parse_prompt(prompt: Any) -> tuple[int, int] | None:
    """(a, b) from a prompt 'A*B' (a string, or chat messages whose last one is it), else None."""
    match = _PROMPT.fullmatch(_text(prompt).strip())
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def _last_turn(completion: Any) -> str | None:
    """The model's last turn: a text completion as it is; of messages, the last one when it
    is the assistant's (None when it is a tool's: the rollout ended on a tool's answer)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        last = completion[-1]
        return str(last.get("content") or "") if last.get("role") == "assistant" else None
    return None


def extract_answer(completion: Any) -> str | None:
    """The model's last turn when it is digits and nothing else (spaces around it aside), else None."""
    text = _last_turn(completion)
    if text is None or _ANSWER.fullmatch(text.strip()) is None:
        return None
    return text.strip()


def correctness_reward(prompts: list, completions: list, answer: Sequence[Any] | None = None, **columns: Any) -> list:
    """1.0 when the model's last turn is the product, else 0.0; None: no reference. The
    reference is the `answer` column, or a*b from the prompt without one."""
    if answer is None:
        golds = [None if (ab := parse_prompt(p)) is None else str(ab[0] * ab[1]) for p in prompts]
    else:
        golds = [None if gold is None else str(gold).strip() for gold in answer]
    return [
        None if gold is None else float(extract_answer(completion) == gold)
        for completion, gold in zip(completions, golds, strict=True)
    ]


def tool_use(prompt: Any, completion: Any) -> str:
    """How a sample used the tool: "none" (no call), "right" (every call is multiply with
    the prompt's operands, in either order) or "wrong" (any other call)."""
    calls = [
        call.get("function", call)
        for message in (completion if isinstance(completion, list) else [])
        if isinstance(message, dict) and message.get("role") == "assistant"
        for call in message.get("tool_calls") or []
    ]
    if not calls:
        return "none"
    operands = parse_prompt(prompt)
    expected = None if operands is None else sorted(operands)
    for call in calls:
        arguments = call.get("arguments")
        if call.get("name") != "multiply" or not isinstance(arguments, dict) or set(arguments) != {"a", "b"}:
            return "wrong"
        values = [arguments["a"], arguments["b"]]
        if not all(type(v) is int for v in values) or sorted(values) != expected:
            return "wrong"
    return "right"


task = Task(name="multiply", verifier=correctness_reward, extract_answer=extract_answer, rows=make_rows)


# ---- the model's tokenizer and its warm-up data -------------------------------------------------

# The Qwen2.5/Hermes tool-call format in as few characters as it takes: the tools by name in
# the system turn (their schemas are the tiny model's to learn, not to read), a call as a
# <tool_call> block of JSON, a tool's answer in a turn of its own. transformers renders with
# trim_blocks, so a newline after a tag is written {{ nl }}.
CHAT_TEMPLATE = (
    "{% set nl = '\\n' %}"
    "{% if tools %}<|im_start|>system{{ nl }}tools:"
    "{% for tool in tools %} {{ (tool.function or tool).name }}{% endfor %}<|im_end|>{{ nl }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>tool{{ nl }}{{ m.content }}<|im_end|>{{ nl }}"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}{{ nl }}{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>{{ nl }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ nl }}{% endif %}"
)


def chat_tokenizer():
    """A character tokenizer with ChatML turns (<|im_end|> the EOS), <tool_call> tags as
    tokens of their own, and `CHAT_TEMPLATE`."""
    from grpo.tasks.tiny import tool_chat_tokenizer

    tokenizer = tool_chat_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(multiply)


def _call(a: int, b: int) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}],
    }


def conversations(n: int, *, seed: int, digits: int = 2, tool_share: float = 0.5, shown_share: float = 0.75) -> list:
    """`n` `grpo sft` rows ({"messages", "tools"}): a share `shown_share` of them show the
    tool, and of those a share `tool_share` call it (then answer with its result); every
    other row answers in the head, with the true product (which a tiny model cannot learn).
    The warmed-up model then calls the tool only part of the time: RL has something to raise."""
    if not (0.0 <= tool_share <= 1.0 and 0.0 <= shown_share <= 1.0):
        raise UserError(f"multiply: tool_share and shown_share must be in [0, 1], got {tool_share} and {shown_share}")
    rng, schema = random.Random(seed), _schema()
    rows = []
    for _ in range(n):
        a, b = _operands(rng, digits)
        shown = rng.random() < shown_share
        calls = shown and rng.random() < tool_share
        messages = _prompt(a, b)
        if calls:
            messages += [_call(a, b), {"role": "tool", "name": "multiply", "content": str(a * b)}]
        messages.append({"role": "assistant", "content": str(a * b)})
        rows.append({"messages": messages, "tools": [schema] if shown else None})
    return rows


def save_base(directory: str | Path, *, hidden_size: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> Path:
    """A randomly initialised tiny Llama with `chat_tokenizer`, saved to `directory`: the
    model `grpo sft` then warms up on `conversations`."""
    from grpo.tasks.tiny import tiny_llama

    directory = Path(directory)
    tokenizer = chat_tokenizer()
    model = tiny_llama(tokenizer, hidden_size=hidden_size, layers=layers, heads=heads, max_positions=256, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
