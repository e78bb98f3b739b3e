"""The optimizer, built by one factory from train.optimizer (docs/memory.md).

- `adamw`: torch's AdamW, fused (one pass over each tensor on CPU and CUDA). Exact fp32
  moments: 8 bytes a trained parameter.
- `adamw_8bit`: bitsandbytes' AdamW8bit (Dettmers et al., arXiv 2110.02861): both moments
  kept in 8 bits, quantised block-wise with the dynamic map, each block its own scale, so
  about 2 bytes a parameter. Each step dequantises one tensor's moments (on a CPU, a large
  tensor's piece by piece: `_adamw_8bit_in_pieces`), applies AdamW's update in fp32 and quantises them
  again; small tensors keep fp32 moments. The update
  approximates AdamW's (tests/train/test_optimizers.py says to what tolerance).

Why bitsandbytes rather than torchao's AdamW8bit: bitsandbytes steps on a CPU in its own
native code, where torchao compiles its step with torch.compile (a slow first step, a C
compiler at run time); its state dict is plain tensors (uint8 moments, fp32 scales) that a
checkpoint loads with weights_only=True; and it is what TRL's optim="adamw_8bit" runs. The
measurements behind the choice are in docs/memory.md. It runs in one process: under torchrun
the launch check refuses it (grpo.refusals, adamw_8bit+torchrun).

`train.optimizer_in_backward` (torchtune's optimizer_in_bwd) wraps either in `StepInBackward`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable

import torch

from grpo.errors import UserError, first_line

__all__ = ["INSTALL", "OPTIMIZERS", "StepInBackward", "build_optimizer", "missing"]

INSTALL = "pip install 'grpo[memory]' (bitsandbytes)"  # the one install hint


def adamw(groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def adamw_8bit(groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    return _adamw_8bit_in_pieces()(groups, lr=lr, betas=betas, weight_decay=weight_decay)


CHUNK = 1 << 20  # values a piece of a large tensor's 8-bit step on a CPU: a multiple of any power-of-two block up to it


@functools.cache
def _adamw_8bit_in_pieces() -> type:
    """bitsandbytes' AdamW8bit whose CPU step runs a large tensor piece by piece. Its CPU step
    dequantises both moments of the whole tensor to fp32 and makes fp32 temporaries of it:
    about 5x the tensor at once (+742 MB for a 151,936 x 256 embedding). Each piece is a run
    of whole blocks (its values, gradient, moments and their scales sliced alike) and every
    operation of the step is per value or per block, so the pieces give the same bits as the
    whole (tests/train/test_optimizers.py); the transient is then ~5 x CHUNK x 4 bytes. On a
    GPU, for tensors with fp32 moments, and where bitsandbytes' update or state is not laid
    out as the pieces need (`_why_not_in_pieces`: one warning line), bitsandbytes' own step."""
    bnb = _bitsandbytes()

    class AdamW8bitInPieces(bnb.optim.AdamW8bit):
        def update_step(self, group, p, gindex, pindex):
            state = self.state[p]
            if p.device.type != "cpu" or state["state1"].dtype != torch.uint8 or p.numel() <= CHUNK:
                return super().update_step(group, p, gindex, pindex)
            update = bnb.functional.optimizer_update_8bit_blockwise
            why = _why_not_in_pieces(update, p.numel(), state)
            if why is not None:
                _warn_once(f"train.optimizer: adamw_8bit: {why}; each tensor steps whole (more transient memory)")
                return super().update_step(group, p, gindex, pindex)
            p.data = p.data.contiguous()
            p.grad = p.grad.contiguous()
            config = self.get_config(gindex, pindex, group)
            state["step"] += 1
            (beta1, beta2), step, block = config["betas"], state["step"], _block_size(p.numel(), state)
            flat = [t.view(-1) for t in (p.grad, p.data, state["state1"], state["state2"])]
            for start in range(0, p.numel(), CHUNK):
                piece, blocks = slice(start, start + CHUNK), slice(start // block, (start + CHUNK) // block)
                grad, value, m1, m2 = (t[piece] for t in flat)
                # AdamW's arguments by name (beta3 and alpha are other optimizers', 0 as bitsandbytes passes them)
                update(
                    optimizer_name=self.optimizer_name, g=grad, p=value, state1=m1, state2=m2, beta1=beta1,
                    beta2=beta2, beta3=0.0, alpha=0.0, eps=config["eps"], step=step, lr=config["lr"],
                    qmap1=state["qmap1"], qmap2=state["qmap2"], absmax1=state["absmax1"][blocks],
                    absmax2=state["absmax2"][blocks], weight_decay=config["weight_decay"], gnorm_scale=1.0,
                    skip_zeros=config["skip_zeros"],
                )  # fmt: skip

    return AdamW8bitInPieces


# The keywords the step in pieces gives bitsandbytes' blockwise update (its names since 0.50).
UPDATE_KEYWORDS = (
    "optimizer_name", "g", "p", "state1", "state2", "beta1", "beta2", "beta3", "alpha", "eps", "step", "lr",
    "qmap1", "qmap2", "absmax1", "absmax2", "weight_decay", "gnorm_scale", "skip_zeros",
)  # fmt: skip


def _block_size(numel: int, state: dict) -> int | None:
    """The values per scale of the 8-bit moments bitsandbytes made for a tensor of `numel`
    values, read from their scales (`absmax1`, `absmax2`: one per block, the last block
    partial): the power of two b with ceil(numel / b) scales (at most one has), or None where
    the two moments' scales differ or no power of two gives their count."""
    blocks = state["absmax1"].numel()
    if state["absmax2"].numel() != blocks:
        return None
    return next((1 << k for k in range(numel.bit_length() + 1) if -(-numel // (1 << k)) == blocks), None)


@functools.cache  # the update's signature, once per process (and per function, where one is planted in a test)
def _takes_keywords(update: Callable) -> str | None:
    """Why bitsandbytes' blockwise update cannot be called with UPDATE_KEYWORDS, or None."""
    try:
        inspect.signature(update).bind(**dict.fromkeys(UPDATE_KEYWORDS))
    except (TypeError, ValueError) as err:
        return f"bitsandbytes' optimizer_update_8bit_blockwise takes other arguments ({first_line(err)})"
    return None


def _why_not_in_pieces(update: Callable, numel: int, state: dict) -> str | None:
    """Why a tensor of `numel` values with 8-bit `state` cannot step in pieces of CHUNK values
    (the moments' block layout, or the update's arguments), or None."""
    block = _block_size(numel, state)
    if block is None:
        scales = (state["absmax1"].numel(), state["absmax2"].numel())
        return f"bitsandbytes' 8-bit moments of {numel} values have {scales} scales, in no block layout the pieces know"
    if CHUNK % block:
        return f"bitsandbytes' 8-bit moments come in blocks of {block} values, which do not divide pieces of {CHUNK}"
    return _takes_keywords(update)


@functools.cache  # one line a process for each reason
def _warn_once(message: str) -> None:
    print(f"grpo: warning: {message}", file=sys.stderr)


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
    settings = dict(lr=train.lr, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)
    if getattr(train, "optimizer_in_backward", False):
        return StepInBackward(groups, lambda group: make([group], **settings))
    return make(groups, **settings)


class StepInBackward(torch.optim.Optimizer):
    """The optimizer step inside the backward pass (train.optimizer_in_backward): one optimizer
    per trained tensor, stepped by the tensor's post-accumulate-grad hook as soon as the
    backward has completed its gradient, which is then freed, so that the whole set of
    gradients is never held at once (only the tensors whose gradients are in flight).

    The same update as the wrapped optimizer's step over all tensors, provided each step's
    gradient comes from one backward (no accumulation over micro-batches) and nothing clips by
    the global norm; the config check refuses both (grpo.refusals, in-backward+...). `step`
    and `zero_grad` have nothing left to do; the param groups are the scheduler's handle on
    the learning rate, read by each tensor's step. Each gradient's norm is kept for the grad_norm
    metric (`norm`)."""

    def __init__(self, groups: list[dict], make: Callable[[dict], torch.optim.Optimizer]):
        super().__init__(groups, defaults={})
        self._each: dict[torch.Tensor, tuple[torch.optim.Optimizer, dict]] = {}
        self._norms: dict[torch.Tensor, torch.Tensor] = {}
        self._hooks = []
        for group in self.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                self._each[p] = (make({"params": [p], **settings}), group)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._step_one))

    def _step_one(self, p: torch.Tensor) -> None:
        optimizer, group = self._each[p]
        self._norms[p] = torch.linalg.vector_norm(p.grad.detach())
        optimizer.param_groups[0]["lr"] = group["lr"]  # as the scheduler set it
        optimizer.step()
        p.grad = None

    def step(self, closure=None) -> None:
        """Nothing: every tensor stepped when its gradient was complete."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each gradient was freed after its step."""

    def norm(self, params: list) -> float:
        """The L2 norm of the last gradients of `params` (those the backward stepped since the
        last call), as clip_grad_norm would have measured them."""
        norms = [self._norms.pop(p) for p in params if p in self._norms]  # each tensor's, then theirs: as torch's
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def state_dict(self) -> dict:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"param_groups": groups, "each": [optimizer.state_dict() for optimizer, _ in self._each.values()]}

    def load_state_dict(self, state: dict) -> None:
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        for (optimizer, _), saved in zip(self._each.values(), state["each"], strict=True):
            optimizer.load_state_dict(saved)

    def remove_hooks(self) -> None:
        """Detach from the parameters (a model trained on by another optimizer afterwards)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


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
