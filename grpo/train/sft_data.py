"""SFT's data: what a sequence to learn is (pieces of text, read or learned), how it is encoded
exactly as the RL sampler encodes a prompt (`encode_pieces`), padded into batches, and how the
user's rows (`grpo sft --data`: prompt and completion, or chat messages with their tools)
become those sequences, checked row by row and cut to the model's length. The training loop
that learns from them is grpo.train.sft."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

from grpo.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from grpo.train.sft import FineTuneConfig

IGNORE_INDEX = -100  # the label that cross_entropy skips: prompt and padding positions

# A sequence to learn, as texts in order: (context, False) is read only; (completion, True) is
# learned, with an EOS after it.
Pieces = list[tuple[str, bool]]
# One encoded sequence: its token ids and its labels (IGNORE_INDEX where nothing is learned).
Example = tuple[list[int], list[int]]


def encode_pieces(tokenizer, pieces: Pieces, *, chat: bool = False) -> Example:
    """Token ids and labels of one sequence. A context piece is tokenized as the RL sampler
    tokenizes a prompt (`chat`: rendered by the chat template, which writes its own special
    tokens; else the tokenizer's, once, at the start of the sequence) and labelled
    IGNORE_INDEX; a completion piece is tokenized without special tokens, followed by EOS, and
    labelled with its own ids."""
    ids: list[int] = []
    labels: list[int] = []
    for number, (text, learned) in enumerate(pieces):
        if learned:
            part = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
            labels += part
        else:
            part = tokenizer(text, add_special_tokens=number == 0 and not chat)["input_ids"]
            labels += [IGNORE_INDEX] * len(part)
        ids += part
    return ids, labels


def pad(examples: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels`, each (B, L)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, L)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # (B, L)
    for i, (ids, target) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(target)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def padding_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def completion_batch(tokenizer, prompts: list, completions: list[str]) -> dict[str, Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels`, each (B, L), for the
    sequences prompt + completion + EOS. A prompt is a string or a list of chat messages and
    is encoded as the RL sampler encodes it. `labels` is `input_ids` with IGNORE_INDEX (-100)
    on the prompt and the padding, so only the completion and its EOS are learned."""
    from grpo.rollout.prompts import prompt_text

    examples = [
        encode_pieces(
            tokenizer, [(prompt_text(prompt, tokenizer), False), (completion, True)], chat=not isinstance(prompt, str)
        )
        for prompt, completion in zip(prompts, completions, strict=True)
    ]
    return pad(examples, padding_id(tokenizer))


def conversation_pieces(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[Pieces, bool]:
    """The pieces of a conversation whose assistant messages are learned, and whether all of
    them are (False: only the last one).

    Each assistant message (after at least one other message) is learned from the
    conversation before it as the sampler would render it, `prompt_text` (the chat template
    with the generation prompt, and `tools`' JSON schemas when given), followed by EOS; the
    template's text between one assistant message and the next context is read. What is
    learned of a turn is the template's rendering of it: its content, or for a message with
    `tool_calls` the <tool_call> blocks the template writes (what a model with tools samples,
    grpo.rollout.tools). Tool messages are context, as the tokens a sampler appends after a
    call are. That needs a template that renders a conversation as its prefixes: the
    rendering of the messages up to a turn begins with the one up to the turn before, and a
    turn ends with the EOS token. Otherwise only the last assistant message is learned, which
    is a prompt (the conversation before it) and a completion."""
    from grpo.rollout.prompts import prompt_text

    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    eos = tokenizer.eos_token
    pieces: Pieces = []
    consumed = ""  # the rendered conversation the pieces so far stand for
    for i in turns:
        before = prompt_text(messages[:i], tokenizer, tools)
        after = tokenizer.apply_chat_template(messages[: i + 1], tools=tools or None, tokenize=False)
        stop = after.find(eos, len(before)) if after.startswith(before) else -1
        if not before.startswith(consumed) or stop < 0:
            last = turns[-1]
            only_last = [(prompt_text(messages[:last], tokenizer, tools), False), (messages[last]["content"], True)]
            return only_last, len(turns) == 1
        turn = after[len(before) : stop]  # the message as rendered: its content, its tool calls
        pieces += [(before[len(consumed) :], False), (turn, True)]
        consumed = before + turn + eos
    return pieces, True


# ---- the user's rows ---------------------------------------------------------------------------


def load_rows(c: FineTuneConfig) -> tuple[str, list[dict]]:
    """The rows and their shape ("prompt" or "messages")."""
    from grpo.data import load_rows_for_options

    if c.messages_column is not None:
        return "messages", load_rows_for_options(
            c.data, prompt_column=c.messages_column, column_option="--messages-column"
        )
    try:
        return "prompt", load_rows_for_options(c.data, prompt_column=c.prompt_column)
    except UserError as err:
        if c.prompt_column != type(c).prompt_column:  # not the default: the user named it
            raise
        try:  # no prompts, but maybe conversations
            return "messages", load_rows_for_options(
                c.data, prompt_column="messages", column_option="--messages-column"
            )
        except UserError:
            raise err from None


def _completion_text(value) -> str | None:
    """A completion as text: a string, a number, or TRL's [{"role": "assistant", "content": ...}]."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if (
        isinstance(value, list)
        and len(value) == 1
        and isinstance(value[0], dict)
        and value[0].get("role") == "assistant"
        and isinstance(value[0].get("content"), str)
    ):
        return value[0]["content"]
    return None


def _row_tools(row: dict, where: str) -> list[dict] | None:
    """A conversation's `tools` column (TRL's name): the JSON schemas of the tools its prompt
    shows, each a schema or a 'pkg.module:function' spec (its schema built as rollout.tools
    builds it). None without the column."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, (dict, str)) for t in tools):
        raise UserError(f"{where}: 'tools' must be a list of JSON schemas or 'pkg.module:function' specs")
    if all(isinstance(t, dict) for t in tools):
        return tools
    from grpo.rollout.tools import Toolbox

    return [t if isinstance(t, dict) else Toolbox([t]).schemas[0] for t in tools]


def row_pieces(row: dict, shape: str, c: FineTuneConfig, tokenizer, where: str) -> tuple[Pieces, bool]:
    """The pieces of one row, and whether all its assistant messages are learned."""
    from grpo.rollout.prompts import prompt_text

    if shape == "messages":
        column = c.messages_column or "messages"
        messages = row[column]
        if not isinstance(messages, list):
            raise UserError(f"{where}: {column!r} must be a list of chat messages, got {type(messages).__name__}")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
        if not turns:
            raise UserError(f"{where}: no assistant message after another message: nothing to learn")
        for i in turns:
            if not (messages[i].get("content") or "").strip() and not messages[i].get("tool_calls"):
                raise UserError(f"{where}: message {i + 1} (the assistant's) is empty")
        return conversation_pieces(tokenizer, messages, _row_tools(row, where))
    column = c.completion_column
    if column not in row:
        raise UserError(
            f"{where}: no column {column!r} (columns: {', '.join(row)}); "
            "name the completions' column with --completion-column"
        )
    completion = _completion_text(row[column])
    if completion is None:
        raise UserError(
            f"{where}: {column!r} must be a string or an assistant message, got {type(row[column]).__name__}"
        )
    if not completion.strip():
        raise UserError(f"{where}: empty completion in {column!r}")
    return [(prompt_text(row[c.prompt_column], tokenizer), False), (completion, True)], True


def encode_rows(rows: list[dict], shape: str, c: FineTuneConfig, tokenizer) -> tuple[list[Example], int]:
    """Every row encoded, and how many conversations have only their last assistant message learned."""
    from jinja2 import TemplateError

    examples, last_only = [], 0
    for number, row in enumerate(rows, start=1):
        where = f"{c.data} row {number}"
        try:
            pieces, all_turns = row_pieces(row, shape, c, tokenizer, where)
        except TemplateError as err:
            raise UserError(f"{where}: the tokenizer's chat template cannot render it ({err})") from None
        chat = shape == "messages" or not isinstance(row.get(c.prompt_column), str)
        examples.append(encode_pieces(tokenizer, pieces, chat=chat))
        last_only += not all_turns
    return examples, last_only


def fit_length(
    examples: list[Example], positions: int | None, max_length: int | None, name: str
) -> tuple[list[Example], int]:
    """The examples within `max_length` tokens (None: the model's positions), and how many
    were cut to their last max_length tokens; a row that cannot be cut is an error."""
    if max_length is not None and positions is not None and max_length > positions:
        raise UserError(f"--max-length: {max_length} is more than the model's {positions} positions")
    limit = max_length or positions
    kept, cut = [], 0
    for number, (ids, labels) in enumerate(examples, start=1):
        if limit is None or len(ids) <= limit:
            kept.append((ids, labels))
            continue
        where = f"{name} row {number}"
        if max_length is None:
            raise UserError(
                f"{where}: {len(ids)} tokens, more than the model's {positions} positions; "
                "pass --max-length N to cut long rows to their last N tokens"
            )
        # The learned tokens after the last read one: the final completion and its EOS.
        completion = (
            len(labels) - 1 - next((i for i in range(len(labels) - 1, -1, -1) if labels[i] == IGNORE_INDEX), -1)
        )
        if completion > max_length - 1:  # the completion needs at least one token of context before it
            raise UserError(
                f"{where}: its completion and EOS alone are {completion} tokens, too many for --max-length {max_length}"
            )
        kept.append((ids[-max_length:], labels[-max_length:]))
        cut += 1
    return kept, cut


def shuffled_batches(examples: list[Example], batch_size: int, seed: int, pad_id: int) -> Iterator[dict]:
    """Batches of the examples, one shuffled pass after another, the order from a private
    `random.Random(seed)` (the global random state is neither read nor moved)."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield pad([examples[i] for i in order[start : start + batch_size]], pad_id)
