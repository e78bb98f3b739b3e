"""From prompts to the tokens a decoder starts from, the same for single-turn and multi-turn
rollouts (`grpo.rollout.sampler`, `grpo.rollout.turns`) and for SFT's examples.

Context limits. A prompt longer than `max_prompt_length` tokens (rollout.max_prompt_length;
0 = no limit), counted after the chat template and the tokenizer's special tokens, keeps its
last max_prompt_length tokens, as TRL's GRPOTrainer truncates (from the left: the end of a
prompt is where the question and the generation prompt are). The Rollout's `prompts` then
hold the kept tokens decoded, i.e. what the model saw, and `prompt_truncated` marks their
rows; the data rows, whose prompt column reward functions get, keep the whole prompt.
Prompt + max_new_tokens must fit the model's positions (`context_length`): `check_context`
checks the config's numbers up front, and `check_fits` each batch's longest prompt (a GPT-2
would otherwise fail deep in its position embedding, and a Llama-family model would silently
run past its context).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.errors import UserError
from grpo.infra.hf import context_length


def prompt_text(prompt, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """The text the model sees: a plain prompt as is; chat messages through the chat template
    (with the JSON schemas of `tools`, when given, as a sampler with tools renders them, and
    `template_kwargs`, rollout.chat_template_kwargs, as the template's own variables)."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("the prompts are chat messages but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        prompt, tools=tools or None, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


def keep_last_tokens(
    ids: torch.Tensor, mask: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts (B, P) and their mask cut to each prompt's last `length` tokens
    (0 = no limit), and (B,) bool: which prompts lost tokens. With left padding a prompt's last
    `length` tokens are the batch's last `length` columns, so TRL's GRPOTrainer's
    `prompt_ids[:, -max_prompt_length:]` cuts every prompt right."""
    if not length:
        return ids, mask, torch.zeros(len(ids), dtype=torch.bool)
    return ids[:, -length:], mask[:, -length:], mask.sum(1) > length


def encode_prompts(
    tokenizer, texts: list[str], max_prompt_length: int, *, chat: bool | Sequence[bool] = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Rendered prompts -> (B, P) ids left-padded (by `tokenizer`, set to pad on the left),
    their (B, P) mask and (B,) bool cut, each prompt keeping its last `max_prompt_length`
    tokens (module doc), and the texts as the model sees them (a cut prompt's kept tokens).
    `chat` (for all texts, or one each): rendered by the chat template, which writes the
    special tokens it wants (Llama 3's, Gemma's and Mistral's their BOS), so the tokenizer
    adds none, as TRL tokenizes them; a plain prompt gets the tokenizer's own (its BOS)."""
    flags = [chat] * len(texts) if isinstance(chat, bool) else list(chat)
    if len(set(flags)) <= 1:
        special = not (flags and flags[0])
        encoded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=special)
    else:  # plain and chat prompts in one batch: each tokenized as it is, then padded together
        rows = [tokenizer(text, add_special_tokens=not flag)["input_ids"] for text, flag in zip(texts, flags)]
        encoded = tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    ids, mask, cut = keep_last_tokens(encoded["input_ids"], encoded["attention_mask"], max_prompt_length)
    seen = [
        tokenizer.decode(row[row_mask.bool()], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if was_cut
        else text
        for text, row, row_mask, was_cut in zip(texts, ids, mask, cut.tolist())
    ]
    return ids, mask, cut, seen


def check_context(model_or_config, max_prompt_length: int, max_new_tokens: int, *, key: str = "rollout") -> None:
    """A one-line UserError when prompts of `max_prompt_length` tokens with `max_new_tokens`
    more cannot fit the model's positions (nothing to check when its config names none).
    `key` is the config section the two numbers come from. With max_prompt_length 0 (no limit)
    there is nothing to check up front: `check_fits` checks each batch's prompts."""
    positions = context_length(model_or_config)
    total = max_prompt_length + max_new_tokens
    if max_prompt_length and positions is not None and total > positions:
        raise UserError(
            f"{key}.max_prompt_length ({max_prompt_length}) + {key}.max_new_tokens ({max_new_tokens}) = {total} "
            f"tokens exceed the model's {positions} positions (lower either)"
        )


def check_fits(model, prompt_length: int, max_prompt_length: int, max_new_tokens: int) -> None:
    """A one-line UserError when a prompt of `prompt_length` tokens (a batch's longest) and
    max_new_tokens more exceed the model's positions; a few attribute reads per call."""
    positions = context_length(model)
    if positions is None or prompt_length + max_new_tokens <= positions:
        return
    check_context(model, max_prompt_length, max_new_tokens)  # raises when the config's numbers are to blame
    room = positions - max_new_tokens  # the longest prompt that fits
    remedy = (
        f"set rollout.max_prompt_length (at most {room}) to keep each prompt's last tokens"
        if room > 0
        else f"rollout.max_new_tokens must be below {positions}"
    )
    raise UserError(
        f"a prompt of {prompt_length} tokens + rollout.max_new_tokens ({max_new_tokens}) = "
        f"{prompt_length + max_new_tokens} tokens exceed the model's {positions} positions; {remedy}"
    )
