"""What the one-time probes share: how close is close, one verdict for every process, and the
one line a fallback prints.

Before a run's first step, probes decide whether a faster path gives a model's own numbers:
the forward layouts (grpo.train.layouts.decide_layouts), the critic's packing
(grpo.train.networks.backbone_packs), attention by segments and its variable-length kernel
(grpo.infra.attention). Each compares the faster path with the plain one on a small input of
its own; a difference within the rounding of the dtype the model computes in passes
(`close`), and any other difference, or an error, keeps the plain path with one warning line
(`warn`). Under torchrun every process probes its own copy, and a path is taken only where
every process found that it serves (`agreed`): processes that took different layouts would
run different passes and wait for each other in a collective.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

STEPS = 4  # rounding steps of the compute dtype a probe allows, times the values' scale
# float32's floor: its sums over a wide model's hidden size and many layers, taken in another
# order by each layout, round by more than a step of the dtype.
FLOOR = 2.0**-13
_TF32 = 2.0**-10  # TF32's rounding step: float32 matrix products on a GPU that allows it


def rounding(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The relative rounding step of arithmetic in `dtype` on `device`: the dtype's epsilon, or
    a coarser one where torch runs float32 matrix products in less (TF32 or bf16 where
    `torch.set_float32_matmul_precision` or the CUDA TF32 switch allows it)."""
    if dtype not in (torch.float32, torch.float64):
        return torch.finfo(dtype).eps
    eps = torch.finfo(dtype).eps
    precision = torch.get_float32_matmul_precision()
    if precision == "medium":
        return max(eps, torch.finfo(torch.bfloat16).eps)
    tf32 = torch.device(device).type == "cuda" and getattr(torch.backends.cuda.matmul, "allow_tf32", False)
    return max(eps, _TF32) if precision == "high" or tf32 else eps


def tolerance(dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The largest difference a probe allows, relative to the values' scale: STEPS rounding
    steps of `dtype` (`rounding`), and never less than FLOOR."""
    return max(STEPS * rounding(dtype, device), FLOOR)


def close(got: Tensor, want: Tensor, dtype: torch.dtype, where: Tensor | None = None) -> bool:
    """Whether `got` equals `want` within `tolerance(dtype)` times want's largest magnitude,
    at the entries `where` is true (a mask of want's leading dims; all entries if None). A NaN
    or an infinity there is never close."""
    diff = (got.detach().float() - want.detach().float()).abs()
    size = want.detach().float().abs()
    if where is not None:
        where = where.bool().view(*where.shape, *[1] * (want.dim() - where.dim())).expand_as(want)
        diff, size = diff[where], size[where]
    if diff.numel() == 0:
        return True
    scale = float(size.max()) or 1.0
    return bool(diff.max() <= tolerance(dtype, want.device) * scale)


def agreed(world, serves: bool) -> bool:
    """True where every process of `world` (grpo.infra.distributed) found that the probed path
    serves: the flags' sum over processes (a collective; every process calls it alike). None:
    one process."""
    if world is None or world.world_size == 1:
        return serves
    return int(world.sum(torch.tensor([int(serves)]))) == world.world_size


def warn(line: str) -> None:
    """The one line a probe's fallback prints."""
    print(f"grpo: warning: {line}", file=sys.stderr)
