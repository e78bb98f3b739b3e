"""Packing whole sequences end to end, the model-side pieces every packed pass shares: the
`Packed` layout and its 4-D mask, first-fit binning, SFT's and the reward model's packing of
right-padded sequences (`pack_sequences`), the mask's dtype, and which models the packed mask
does not serve (`windowed`). grpo.train.packed_layout packs a rollout's prompts and completions
with them; grpo.train.sft and grpo.rewards.model pack plain sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packed:
    """A micro-batch packed into B bins of L slots."""

    input_ids: Tensor  # (B, L): the real tokens, 0 in a bin's unused slots
    position_ids: Tensor  # (B, L): each token's position in its own sequence
    units: Tensor  # (B, L) long: the unit each slot holds, -1 where none
    branches: Tensor  # (B, L) long: 0 a prompt's token, k > 0 the k-th completion of its unit, -1 none
    # (N, T) long, slots b * L + l: `pack`'s, the slot whose output predicts each completion
    # token; `pack_sequences`', each token's own slot
    index: Tensor

    @property
    def tokens(self) -> int:
        """The real tokens packed."""
        return int((self.units >= 0).sum())

    def attention_mask(self, dtype: torch.dtype) -> Tensor:
        """(B, 1, L, L), additive: 0 where a query may see a key, the dtype's minimum elsewhere.
        Within a unit, causally: a completion's token sees its prompt and its own completion's
        earlier tokens. An unused slot sees the unused slots before it (never a real token,
        and never nothing: a row of a softmax with no key would be NaN)."""
        units, branches = self.units, self.branches
        slots = torch.arange(units.shape[1], device=units.device)
        causal = slots.view(1, -1, 1) >= slots.view(1, 1, -1)  # (1, L, L): query >= key
        same_unit = units.unsqueeze(2) == units.unsqueeze(1)  # (B, L, L)
        key_branch = branches.unsqueeze(1)
        visible = (key_branch == 0) | (key_branch == branches.unsqueeze(2))
        allowed = causal & same_unit & visible
        mask = torch.zeros(allowed.shape, dtype=dtype, device=units.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def first_fit(sizes: list[int]) -> tuple[list[list[int]], int]:
    """Units of these sizes into bins as long as the longest unit (first fit, longest unit
    first): each bin's units in order, and the longest bin's length."""
    capacity = max(sizes)
    bins: list[list[int]] = []
    filled: list[int] = []
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        for b, used in enumerate(filled):
            if used + sizes[k] <= capacity:
                bins[b].append(k)
                filled[b] += sizes[k]
                break
        else:
            bins.append([k])
            filled.append(sizes[k])
    return bins, max(filled)


def pack_sequences(input_ids: Tensor, attention_mask: Tensor) -> Packed | None:
    """Right-padded rows (N, L) of whole sequences (SFT's: each row one run of real tokens from
    its first column) packed end to end into bins, each sequence its own unit, causal within
    itself; `index` (N, L) is the slot of each row's token (its padding's: the row's first
    slot, outside every use). None when a row is not one run of real tokens from column 0, or
    is empty."""
    attention = attention_mask.cpu().bool()
    lengths = attention.sum(1)
    columns = torch.arange(attention.shape[1])
    if bool((lengths == 0).any()) or not torch.equal(attention, columns < lengths.unsqueeze(1)):
        return None
    sizes = lengths.tolist()
    bins, length = first_fit(sizes)
    ids = input_ids.cpu()
    packed_ids = torch.zeros(len(bins), length, dtype=ids.dtype)
    positions = torch.zeros(len(bins), length, dtype=torch.long)
    unit_of = torch.full((len(bins), length), -1, dtype=torch.long)
    index = torch.zeros(attention.shape, dtype=torch.long)
    for b, members in enumerate(bins):
        at = 0
        for k in members:
            n = sizes[k]
            packed_ids[b, at : at + n] = ids[k, :n]
            positions[b, at : at + n] = torch.arange(n)
            unit_of[b, at : at + n] = k
            index[k] = b * length + at
            index[k, :n] += torch.arange(n)
            at += n
    device = input_ids.device
    return Packed(
        packed_ids.to(device),
        positions.to(device),
        unit_of.to(device),
        unit_of.clamp(max=0).to(device),  # every real token a prompt's (branch 0): seen by its unit's later ones
        index.to(device),
    )


def mask_dtype(model, computes_in: torch.dtype | None = None) -> torch.dtype:
    """The dtype of a packed pass's additive mask: the one the model computes in (autocast's
    where it is on, else `computes_in` where given: the one a bf16-stored reference is cast
    up to, grpo.train.networks; else its weights'); SDPA takes no mask of another float dtype."""
    weight = model.get_input_embeddings().weight
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    dtype = computes_in or weight.dtype
    return dtype if dtype.is_floating_point else torch.float32


def windowed(model) -> bool:
    """Whether some of `model`'s layers attend within a window: a sliding one (Mistral, Gemma 2
    and 3, Cohere 2, a Qwen2 with use_sliding_window) or a chunk (Llama 4's
    attention_chunk_size: a token sees only the earlier ones of its chunk of positions). The
    packed layout's mask cuts neither, and a probe shorter than the window could not tell."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kinds = getattr(config, "layer_types", None)
    return any(
        isinstance(getattr(config, size, None), int) and (kinds is None or any(kind in str(k) for k in kinds))
        for size, kind in (("sliding_window", "sliding"), ("attention_chunk_size", "chunked"))
    )
