"""The packed layout: a pass over a micro-batch's real tokens only, no padding.

The rows' tokens are laid end to end in a few rows ("bins"), each no longer than the longest
unit: a unit is one row's prompt and completion, or, with shared prompts, a group's prompt
once followed by each of its rows' completions. Positions restart at every unit (a
completion continues its prompt's), and a 4-D attention mask keeps every token within its
own sequence: a completion sees its prompt and its own earlier tokens, never another
row's. The outputs at the slots that predict each completion token are then gathered back to
(N, T). The same log-probs as the padded layout to float rounding
(tests/train/test_packing.py); `decide_layouts` takes it for a model only where that holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo.infra import attention
from grpo.infra.packing import Packed, first_fit, mask_dtype
from grpo.rollout import Rollout


def prompt_groups(batch: Rollout) -> tuple[Tensor, Tensor] | None:
    """Runs of consecutive rows with the same prompt (a prompt's G completions): the first row
    of each run (B,) and, for every row, its run (N,). None when no two adjacent rows share one."""
    p_len = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    if p_len == 0 or len(batch) < 2:
        return None
    prompts = batch.input_ids[:, :p_len]
    same = (prompts[1:] == prompts[:-1]).all(1) & (
        batch.attention_mask[1:, :p_len] == batch.attention_mask[:-1, :p_len]
    ).all(1)
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=same.device), ~same])  # (N,)
    return starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1


def real_lengths(batch: Rollout) -> tuple[Tensor, Tensor]:
    """(N,) and (N,) on the CPU: each row's real prompt tokens and real completion tokens (its
    attention mask's, padding left out)."""
    attention = batch.attention_mask.cpu()
    p_len = attention.shape[1] - batch.completion_mask.shape[1]
    return attention[:, :p_len].sum(1), attention[:, p_len:].sum(1)


def pack(batch: Rollout, groups: Tensor | None = None) -> Packed | None:
    """`batch`'s real tokens packed (see the module's docstring). `groups`: each row's group of
    rows sharing one prompt ((N,) run ids from `prompt_groups`; consecutive rows), whose prompt
    is then packed once; None packs every row with its own prompt. None when a row's tokens are
    not one run of real prompt tokens ending at the prompt's last column followed by one run of
    completion tokens from its first (what the samplers make), or a row has no prompt token."""
    t_len = batch.completion_mask.shape[1]
    p_len = batch.input_ids.shape[1] - t_len
    if p_len == 0:
        return None
    attention = batch.attention_mask.cpu()
    prompt_real, completion_real = real_lengths(batch)
    columns = torch.arange(attention.shape[1])
    expected = (columns >= p_len - prompt_real.unsqueeze(1)) & (columns < p_len + completion_real.unsqueeze(1))
    if bool((prompt_real == 0).any()) or not torch.equal(attention.bool(), expected):
        return None
    p_real, c_real = prompt_real.tolist(), completion_real.tolist()
    n = len(batch)
    if groups is None:
        units = [[i] for i in range(n)]
    else:
        units, run = [], groups.tolist()
        for i in range(n):
            if i and run[i] == run[i - 1]:
                units[-1].append(i)
            else:
                units.append([i])
    sizes = [p_real[u[0]] + sum(c_real[i] for i in u) for u in units]
    bins, length = first_fit(sizes)
    ids = batch.input_ids.cpu()
    input_ids = torch.zeros(len(bins), length, dtype=ids.dtype)
    positions = torch.zeros(len(bins), length, dtype=torch.long)
    unit_of = torch.full((len(bins), length), -1, dtype=torch.long)
    branch_of = torch.full((len(bins), length), -1, dtype=torch.long)
    index = torch.zeros(n, t_len, dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for k in members:
            rows = units[k]
            p = p_real[rows[0]]
            input_ids[b, at : at + p] = ids[rows[0], p_len - p : p_len]
            positions[b, at : at + p] = torch.arange(p)
            unit_of[b, at : at + p] = k
            branch_of[b, at : at + p] = 0
            last_prompt = b * length + at + p - 1  # predicts every row's first completion token
            at += p
            for j, i in enumerate(rows):
                c = c_real[i]
                input_ids[b, at : at + c] = ids[i, p_len : p_len + c]
                positions[b, at : at + c] = torch.arange(p, p + c)
                unit_of[b, at : at + c] = k
                branch_of[b, at : at + c] = j + 1
                index[i] = last_prompt  # past the completion's end too: outside every mask
                index[i, 1:c] = b * length + at + torch.arange(c - 1)
                at += c
    device = batch.input_ids.device
    return Packed(
        input_ids.to(device),
        positions.to(device),
        unit_of.to(device),
        branch_of.to(device),
        index.to(device),
    )


def packed_positions(
    model, batch: Rollout, share_prompts: bool, read: Callable, *, computes_in: torch.dtype | None = None
) -> Tensor | None:
    """(N, T, ...) `read(output)` of one packed pass at the slots that predict each completion
    token (see `pack`; with `share_prompts`, a group's prompt packed once); None where the
    batch cannot be packed. `computes_in`: the dtype `model` computes in where that is not its
    weights' (grpo.train.layouts.Verdicts), for the mask."""
    groups = prompt_groups(batch) if share_prompts else None
    packed = pack(batch, None if groups is None else groups[1])
    if packed is None:
        return None
    out = read(
        model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask(mask_dtype(model, computes_in)),
            position_ids=packed.position_ids,
            use_cache=False,
            **attention.arguments(model, packed.units, packed.branches),
        )
    )  # (B, L, ...)
    flat = out.reshape(-1, *out.shape[2:])
    return flat[packed.index]  # (N, T, ...)
