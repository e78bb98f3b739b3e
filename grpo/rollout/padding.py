"""Padding token rows into one tensor: completions on the right (`pad_cat`), prompts and
contexts on the left, where generation starts (`left_pad`).

Shared by the Sampler, the multi-turn rollouts and every decoder (the vLLM one included),
so that none of them imports another for it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def pad_cat(pieces: list[Tensor], pad: float) -> Tensor:
    """Rows from several decoding calls (those that hit EOS early are shorter), right-padded
    with `pad` to the longest and stacked."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([F.pad(p, (0, width - p.shape[1]), value=pad) for p in pieces])


def left_pad(contexts: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    """Token lists -> (B, P) ids left-padded with `pad` to the longest, and their (B, P) mask."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for k, context in enumerate(contexts):
        ids[k, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[k, width - len(context) :] = 1
    return ids.to(device), mask.to(device)
