"""A loaded causal LM made ready to train: activation checkpointing (on and off), LoRA, autocast,
the parameters an optimizer moves. Loading it is `grpo.infra.hf.load_causal_lm`; the forward
passes over a Rollout are `grpo.train.layouts`; the reference and the critic, `grpo.train.networks`.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from grpo.errors import UserError


def autocast(model, dtype: torch.dtype | None):
    """`torch.autocast` in `dtype` on the model's device; does nothing when dtype is None.
    Matmuls run in `dtype`; weights, gradients and optimizer state stay in theirs."""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def enable_checkpointing(model) -> bool:
    """Prepare `model` for activation checkpointing (train.gradient_checkpointing): each decoder
    layer keeps only its input and recomputes the rest in the backward pass. transformers
    checkpoints only in training mode, so dropout is switched off for good here (RL runs
    without it) and `activation_checkpointing` puts the model in training mode for the
    policy's forward only. A model that cannot checkpoint (no transformers support) trains
    without, with a warning, since checkpointing is on by default: returns whether it is on."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        print(
            f"grpo: warning: train.gradient_checkpointing: {type(model).__name__} does not support it; "
            "training without (more activation memory)",
            file=sys.stderr,
        )
        return False
    _no_dropout(model)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the older name is deprecated there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def _no_dropout(model) -> None:
    """Every dropout of `model` at probability 0, so that training mode computes what eval mode
    does: the nn.Dropout modules, and the probabilities that layers keep as floats and pass to
    `F.dropout(..., training=self.training)` themselves (OPT's `dropout`, `activation_dropout`
    and `layerdrop`, attention_dropout in most). Otherwise the policy's checkpointed forward
    would drop activations, and the backward's recomputation, which runs after the model is back
    in eval mode, would save other tensors than the forward did (torch's CheckpointError)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


@contextlib.contextmanager
def activation_checkpointing(model, enabled: bool):
    """Training mode (where transformers checkpoints) for the duration, then eval mode again."""
    if not enabled:
        yield
        return
    model.train()
    try:
        yield
    finally:
        model.eval()


def apply_lora(model, r: int, alpha: float, target_modules):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("lora.r > 0 needs peft: pip install 'grpo[lora]'") from None
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=target_modules, bias="none")
    return get_peft_model(model, config).eval()


def disable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_disable"):  # transformers >= 5.x
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def trainable_parameters(model: nn.Module) -> list:
    """The parameters the optimizer moves (with LoRA, the adapter's only)."""
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module | None) -> int:
    return 0 if model is None else sum(p.numel() for p in model.parameters())
