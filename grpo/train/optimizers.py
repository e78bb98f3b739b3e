"""The optimizer, built by one factory from train.optimizer (docs/memory.md).

- `adamw`: torch's AdamW, fused (one pass over each tensor on CPU and CUDA). Exact fp32
  moments: 8 bytes a trained parameter.
- `adamw_8bit`: bitsandbytes' AdamW8bit (Dettmers et al., arXiv 2110.02861): both moments
  kept in 8 bits, quantised block-wise with the dynamic map, each block its own scale, so
  about 2 bytes a parameter. Each step dequantises one tensor's moments, applies AdamW's
  update in fp32 and quantises them again; small tensors keep fp32 moments. The update
  approximates AdamW's (tests/train/test_optimizers.py says to what tolerance).

Why bitsandbytes rather than torchao's AdamW8bit: bitsandbytes steps on a CPU in its own
native code, where torchao compiles its step with torch.compile (a slow first step, a C
compiler at run time); its state dict is plain tensors (uint8 moments, fp32 scales) that a
checkpoint loads with weights_only=True; and it is what TRL's optim="adamw_8bit" runs. The
measurements behind the choice are in docs/memory.md. It runs in one process: under torchrun
the launch check refuses it (grpo.refusals, adamw_8bit+torchrun).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from grpo.errors import UserError, first_line

__all__ = ["INSTALL", "OPTIMIZERS", "build_optimizer", "missing"]

INSTALL = "pip install 'grpo[memory]' (bitsandbytes)"  # the one install hint


def adamw(groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def adamw_8bit(groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    bnb = _bitsandbytes()
    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, weight_decay=weight_decay)


# train.optimizer -> the constructor.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": adamw, "adamw_8bit": adamw_8bit}


def missing(name: str) -> str | None:
    """Why train.optimizer `name` cannot be built here (one line, with the install), or None;
    asked before any model loads."""
    if name == "adamw_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        return f"train.optimizer: adamw_8bit needs bitsandbytes, which is not installed: {INSTALL}"
    return None


def build_optimizer(train, groups: list[dict]) -> torch.optim.Optimizer:
    """The optimizer train.optimizer names over `groups` (torch's param groups, each with its
    lr), with train.adam_betas and train.weight_decay."""
    absent = missing(train.optimizer)
    if absent is not None:
        raise UserError(absent)
    make = OPTIMIZERS[train.optimizer]
    return make(groups, lr=train.lr, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)


def _bitsandbytes():
    """bitsandbytes, imported quietly: on a CPU its import warns about an optional 4-bit
    matmul kernel that no optimizer uses."""
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except Exception as err:  # noqa: BLE001 - installed but broken: one line
        raise UserError(f"train.optimizer: adamw_8bit: bitsandbytes does not load ({first_line(err)})") from None
    finally:
        log.setLevel(level)
    return bitsandbytes
