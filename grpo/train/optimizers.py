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

The run's optimizer (`Optimizer`) owns the whole of an update after the backward: clipping
(train.max_grad_norm), the step and the learning-rate schedule, behind `step() -> grad norm`
and `zero_grad()`. Two implementations: `StepAfterBackward` (every gradient held, clipped,
then one step) and `StepInBackward` (train.optimizer_in_backward, torchtune's
optimizer_in_bwd: each tensor stepped as its gradient completes), so the step never asks
which it holds.
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
from grpo.train.schedule import lr_lambda

__all__ = [
    "INSTALL",
    "OPTIMIZERS",
    "Optimizer",
    "StepAfterBackward",
    "StepInBackward",
    "build_optimizer",
    "clip_grad_norm",
    "missing",
]

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
    several times the tensor at once (for a large vocabulary's embedding, more than the 8-bit
    moments save). Each piece is a run
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


def build_optimizer(train, groups: list[dict], updates: int = 1) -> Optimizer:
    """The run's optimizer over `groups` (torch's param groups, each with its lr; the first
    is the policy's, whose gradient norm `step` returns): train.optimizer with
    train.adam_betas and train.weight_decay, stepped after the backward or inside it
    (train.optimizer_in_backward), clipping each group to train.max_grad_norm, its learning
    rate on train.schedule after train.warmup_steps over `updates` optimizer steps."""
    absent = missing(train.optimizer)
    if absent is not None:
        raise UserError(absent)
    make = OPTIMIZERS[train.optimizer]
    settings = dict(lr=train.lr, betas=tuple(train.adam_betas), weight_decay=train.weight_decay)
    schedule = lr_lambda(train.schedule, train.warmup_steps, updates)
    if train.optimizer_in_backward:
        return StepInBackward(PerTensorSteps(groups, lambda group: make([group], **settings)), schedule)
    return StepAfterBackward(make(groups, **settings), schedule, train.max_grad_norm)


def clip_grad_norm(params: list, max_norm: float) -> float:
    """The gradient norm of `params` before clipping (clipped to max_norm when it is > 0).
    Sharded (FSDP2) parameters give the norm of the whole gradient, over all processes."""
    if not params:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class Optimizer:
    """The run's optimizer, as the step sees it: `step()` ends an update (whatever clipping
    and stepping is left, then the schedule's step) and returns the gradient norm of the
    first param group (the policy's) before clipping; `zero_grad()` frees the gradients.
    `torch`: the torch optimizer underneath (its state is what a checkpoint saves);
    `scheduler`: the learning rate's, whose count of steps is the policy's `version`."""

    # Whether the update holds every trained tensor's gradient at once (before the step).
    holds_all_gradients = True

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float]):
        self.torch = optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    @property
    def param_groups(self) -> list[dict]:
        return self.torch.param_groups

    @property
    def version(self) -> int:
        """The optimizer steps taken (the scheduler counts them; a checkpoint keeps the count)."""
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        """The first group's (the policy's) learning rate, as the schedule has set it."""
        return self.scheduler.get_last_lr()[0]

    def step(self) -> float:
        raise NotImplementedError

    def zero_grad(self) -> None:
        self.torch.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.torch.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.torch.load_state_dict(state)


class StepAfterBackward(Optimizer):
    """Every gradient held after the backward: each param group clipped by its own global
    norm (train.max_grad_norm; 0: none), then one step of the torch optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Callable[[int], float], max_grad_norm: float):
        super().__init__(optimizer, schedule)
        self.max_grad_norm = max_grad_norm

    def step(self) -> float:
        norms = [clip_grad_norm(group["params"], self.max_grad_norm) for group in self.torch.param_groups]
        self.torch.step()
        self.scheduler.step()
        return norms[0]


class StepInBackward(Optimizer):
    """The step inside the backward (train.optimizer_in_backward): every tensor was stepped
    when its gradient completed (`PerTensorSteps`), so `step` has only the schedule's step
    left, and reports the norm of the gradients it stepped on. Nothing clips (the config
    check refuses clipping with it: grpo.refusals, in-backward+clipping)."""

    holds_all_gradients = False  # one tensor's at a time

    def __init__(self, optimizer: PerTensorSteps, schedule: Callable[[int], float]):
        super().__init__(optimizer, schedule)

    def step(self) -> float:
        norm = self.torch.norm(self.torch.param_groups[0]["params"])
        self.torch.step()  # nothing left to step; called so that the schedule's step follows one
        self.scheduler.step()
        return norm

    def remove_hooks(self) -> None:
        """Detach from the parameters (a model trained on by another optimizer afterwards)."""
        self.torch.remove_hooks()


class PerTensorSteps(torch.optim.Optimizer):
    """One optimizer per trained tensor, stepped by the tensor's post-accumulate-grad hook
    as soon as the backward has completed its gradient, which is then freed, so that the
    whole set of gradients is never held at once (only the tensors whose gradients are in
    flight).

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
