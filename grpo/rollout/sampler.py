"""The Sampler: from prompts to a Rollout of G completions each.

One class, two decoding loops behind it (`backend`):
- "fast": `grpo.rollout.fast.decode`, a KV-cache loop for Llama-family models that computes
  each prompt's prefix once for its G completions and draws the same tokens as `generate`;
- "hf": `transformers`' `generate` (any causal LM, e.g. a peft-wrapped policy);
- "auto" (default): "fast" where the model is supported, else "hf".

`Sampler.from_config` builds it from the rollout config; training, iterative RL and
evaluation all get theirs from there. The sampler works on its own copy of the tokenizer
(set to pad on the left, where prompts must end), so the caller's tokenizer, and the one
saved with a trained model, is never changed.

Context limits. A prompt longer than `max_prompt_length` tokens (rollout.max_prompt_length;
0 = no limit), counted after the chat template and the tokenizer's special tokens, keeps its
last max_prompt_length tokens, as TRL's GRPOTrainer truncates (from the left: the end of a
prompt is where the question and the generation prompt are). The Rollout's `prompts` then
hold the kept tokens decoded, i.e. what the model saw, and `prompt_truncated` marks their
rows; the data rows, whose prompt column reward functions get, keep the whole prompt.
Prompt + max_new_tokens must fit the model's positions (`context_length`): `check_context`
checks the config's numbers up front, and `sample` checks each batch's longest prompt
(a GPT-2 would otherwise fail deep in its position embedding, and a Llama-family model
would silently run past its context).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from grpo.errors import UserError
from grpo.infra.hf import context_length
from grpo.rollout import fast
from grpo.rollout.batch import Rollout

BACKENDS = ("auto", "fast", "hf")


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


def check_context(model_or_config, max_prompt_length: int, max_new_tokens: int, *, key: str = "rollout") -> None:
    """A one-line UserError when prompts of `max_prompt_length` tokens with `max_new_tokens`
    more cannot fit the model's positions (nothing to check when its config names none).
    `key` is the config section the two numbers come from. With max_prompt_length 0 (no limit)
    there is nothing to check up front: `Sampler.sample` checks each batch's prompts."""
    positions = context_length(model_or_config)
    total = max_prompt_length + max_new_tokens
    if max_prompt_length and positions is not None and total > positions:
        raise UserError(
            f"{key}.max_prompt_length ({max_prompt_length}) + {key}.max_new_tokens ({max_new_tokens}) = {total} "
            f"tokens exceed the model's {positions} positions (lower either)"
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


def _pad_cat(pieces: list[torch.Tensor], pad: int) -> torch.Tensor:
    """Rows of token ids from several decoding calls (those that hit EOS early are shorter),
    right-padded to the longest and stacked."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([F.pad(p, (0, width - p.shape[1]), value=pad) for p in pieces])


class Sampler:
    """G completions per prompt, a prompt's G in contiguous rows: temperature, top-p, top-k,
    min-p, repetition penalty, min/max new tokens, EOS; decoded by the fast loop or by
    `generate` (see the module doc)."""

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
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        batch_size: int = 0,
        backend: str = "auto",
        autocast: torch.dtype | None = None,
        max_prompt_length: int = 0,
    ):
        from transformers import GenerationConfig

        if backend not in BACKENDS:
            raise UserError(f"rollout.sampler: unknown backend {backend!r} (auto, fast or hf)")
        self.tokenizer = copy.deepcopy(tokenizer)  # ours to set up; the caller's stays as it was
        self.tokenizer.padding_side = "left"  # prompts end where generation starts
        self.prompt_column = prompt_column
        self.group_size = group_size
        self.batch_size = batch_size  # completions per decoding call (0 = all): bounds the KV cache
        self.backend = backend
        self.autocast = autocast  # compute dtype for decoding (None = the model's)
        self.max_prompt_length = max_prompt_length  # longer prompts keep their last tokens (0 = no limit)
        self.params = fast.SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=float(min_p),
            repetition_penalty=float(repetition_penalty),
            eos_token_ids=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
        self.generation_config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,  # explicit: GenerationConfig's own default is 50, not off
            min_p=float(min_p),  # 0, not None: None would be filled from the model's own generation config
            # Explicit too: generate fills values left unset from the model's own
            # generation_config.json, and chat models often set a repetition penalty there
            # (the Qwen2.5-Instruct family does). RL must sample from the distribution it
            # scores: only the run's own rollout.repetition_penalty, which the loss applies too.
            repetition_penalty=float(repetition_penalty),
            no_repeat_ngram_size=0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )

    @classmethod
    def from_config(
        cls,
        tokenizer,
        rollout,
        *,
        prompt_column: str,
        autocast: torch.dtype | None = None,
        group_size: int | None = None,
    ) -> Sampler:
        """The sampler that `rollout` (a `grpo.config.RolloutConfig`) describes; `group_size`
        overrides the config's (iterative RL samples its own number per prompt)."""
        return cls(
            tokenizer,
            prompt_column=prompt_column,
            group_size=rollout.group_size if group_size is None else group_size,
            max_new_tokens=rollout.max_new_tokens,
            min_new_tokens=rollout.min_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            min_p=rollout.min_p,
            repetition_penalty=rollout.repetition_penalty,
            batch_size=rollout.generation_batch_size,
            backend=rollout.sampler,
            autocast=autocast,
            max_prompt_length=rollout.max_prompt_length,
        )

    def uses_fast(self, model, prompt_length: int) -> bool:
        """Whether `model` is decoded by the fast loop (raises if "fast" was asked for and cannot run)."""
        if self.backend == "hf":
            return False
        reason = fast.supported(model, prompt_length + self.params.max_new_tokens)
        if reason is not None and self.backend == "fast":
            raise UserError(f"rollout.sampler: fast cannot decode this model: {reason}; use auto or hf")
        return reason is None

    def _check_fits(self, model, prompt_length: int) -> None:
        """A one-line UserError when a prompt of `prompt_length` tokens (a batch's longest) and
        max_new_tokens more exceed the model's positions; a few attribute reads per call."""
        max_new_tokens = self.params.max_new_tokens
        positions = context_length(model)
        if positions is None or prompt_length + max_new_tokens <= positions:
            return
        check_context(model, self.max_prompt_length, max_new_tokens)  # raises when the config's numbers are to blame
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

    def _fast_loop(self, model):
        """fast.decode with the model's fused weights, built once for every chunk of this sample."""
        weights = fast.fuse_weights(model, self.autocast or next(model.parameters()).dtype)
        return lambda ids, mask, counts, seeds: fast.decode(
            model, ids, mask, counts, self.params, weights=weights, seeds=seeds
        )

    def _generate_loop(self, model):
        """transformers' generate, one row per completion; with seeds, one call per prompt,
        each under its own seed (generate draws from the global stream)."""

        def generate(ids, mask, counts, seeds=None):
            if seeds is not None:
                devices = [ids.device] if ids.device.type == "cuda" else []
                pieces = []
                for i, seed in enumerate(seeds):
                    with torch.random.fork_rng(devices=devices):
                        torch.manual_seed(seed)
                        pieces.append(generate(ids[i : i + 1], mask[i : i + 1], counts[i : i + 1]))
                return _pad_cat(pieces, self.params.pad_token_id)
            ids, mask = ids.repeat_interleave(counts, 0), mask.repeat_interleave(counts, 0)
            with torch.autocast(ids.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=self.generation_config)
            return out[:, ids.shape[1] :]

        return generate

    @torch.no_grad()
    def sample(self, model, rows: list[dict], seeds: list[int] | None = None) -> Rollout:
        """G completions of each row's prompt. With `seeds` (one per row), row i's completions
        are drawn from their own generator seeded with seeds[i]: they do not depend on the
        other rows sampled beside them (nor on how many processes share a step), given the
        same generation_batch_size. Without, all rows draw from the global random stream.
        Prompts longer than max_prompt_length keep their last tokens (see the module doc)."""
        tok = self.tokenizer
        texts = [prompt_text(row[self.prompt_column], tok) for row in rows]
        encoded = tok(texts, padding=True, return_tensors="pt", add_special_tokens=True)
        unique_ids, unique_mask, cut = keep_last_tokens(  # (B, P), (B, P), (B,)
            encoded["input_ids"], encoded["attention_mask"], self.max_prompt_length
        )
        self._check_fits(model, unique_ids.shape[1])
        texts = [  # what the model sees: a cut prompt's kept tokens
            tok.decode(ids[mask.bool()], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if was_cut
            else text
            for text, ids, mask, was_cut in zip(texts, unique_ids, unique_mask, cut.tolist())
        ]
        device = next(model.parameters()).device
        unique_ids, unique_mask = unique_ids.to(device), unique_mask.to(device)
        prompt_ids = unique_ids.repeat_interleave(self.group_size, 0)  # (N, P)
        prompt_mask = unique_mask.repeat_interleave(self.group_size, 0)
        generate = self._fast_loop(model) if self.uses_fast(model, prompt_ids.shape[1]) else self._generate_loop(model)
        # In chunks of `batch_size` rows; a chunk holds each of its distinct prompts once.
        prompt_of_row = torch.arange(len(rows), device=device).repeat_interleave(self.group_size)  # (N,)
        pieces = []
        size = self.batch_size or len(prompt_of_row)
        if seeds is not None:  # whole prompts per call: a prompt's generator draws all its rows
            size = max(size // self.group_size, 1) * self.group_size
        for chunk in prompt_of_row.split(size):
            which, counts = torch.unique_consecutive(chunk, return_counts=True)
            chunk_seeds = None if seeds is None else [seeds[i] for i in which.tolist()]
            pieces.append(generate(unique_ids[which], unique_mask[which], counts, chunk_seeds))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        completion_ids = _pad_cat(pieces, pad)  # (N, T)
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
            prompt_truncated=cut.repeat_interleave(self.group_size).to(device),
        )
