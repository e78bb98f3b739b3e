"""Samplers: from prompts to a Rollout of G completions each.

`HFSampler` uses `transformers`' `generate` with sampling. Each prompt is tokenized once and
repeated G times, so the G completions of a prompt are contiguous rows.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from grpo.errors import UserError
from grpo.rollout.batch import Rollout


class Sampler(Protocol):
    def sample(self, model, rows: list[dict]) -> Rollout: ...


def prompt_text(prompt, tokenizer) -> str:
    """The text the model sees: a plain prompt as is; chat messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("the prompts are chat messages but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """(N, T) float: 1 up to and including the first EOS of each row, 0 after it."""
    n, t_len = completion_ids.shape
    if eos_token_id is None:
        return torch.ones(n, t_len)
    is_eos = completion_ids == eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((n,), t_len))
    return (torch.arange(t_len).unsqueeze(0) <= first_eos.unsqueeze(1)).float()


class HFSampler:
    """Sampling with `model.generate`: temperature, top-p, top-k, min/max new tokens, EOS."""

    def __init__(
        self,
        tokenizer,
        *,
        prompt_column: str,
        group_size: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_size: int = 0,
    ):
        from transformers import GenerationConfig

        self.tokenizer = tokenizer
        self.prompt_column = prompt_column
        self.group_size = group_size
        self.batch_size = batch_size  # completions per generate call (0 = all): bounds the KV cache
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,  # explicit: GenerationConfig's own default is 50, not off
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )

    @torch.no_grad()
    def sample(self, model, rows: list[dict]) -> Rollout:
        tok = self.tokenizer
        texts = [prompt_text(row[self.prompt_column], tok) for row in rows]
        tok.padding_side = "left"  # prompts end where generation starts
        encoded = tok(texts, padding=True, return_tensors="pt", add_special_tokens=True)
        device = next(model.parameters()).device
        prompt_ids = encoded["input_ids"].repeat_interleave(self.group_size, 0).to(device)  # (N, P)
        prompt_mask = encoded["attention_mask"].repeat_interleave(self.group_size, 0).to(device)
        chunk = self.batch_size or len(prompt_ids)
        pieces = [
            model.generate(input_ids=ids, attention_mask=m, generation_config=self.generation_config)[:, ids.shape[1] :]
            for ids, m in zip(prompt_ids.split(chunk), prompt_mask.split(chunk))
        ]
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        width = max(p.shape[1] for p in pieces)  # chunks that hit EOS early are shorter
        completion_ids = torch.cat([F.pad(p, (0, width - p.shape[1]), value=pad) for p in pieces])  # (N, T)
        mask = completion_mask(completion_ids.cpu(), tok.eos_token_id).to(device)  # (N, T)
        # Tokens after EOS become padding, so they can never be mistaken for content.
        completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad))
        completions = tok.batch_decode(completion_ids, skip_special_tokens=True)
        repeated_rows = [row for row in rows for _ in range(self.group_size)]
        return Rollout(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, mask.long()], 1),
            completion_mask=mask,
            prompts=[t for t in texts for _ in range(self.group_size)],
            completions=completions,
            rows=repeated_rows,
            group_size=self.group_size,
        )
