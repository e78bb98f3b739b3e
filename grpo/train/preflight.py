"""The checks of a run that need what the engines can do, made once its config is read and
before the process group or any model: what the decoder rollout.sampler names cannot sample
(`grpo.rollout.decoders`: the fast loop's own options, a LoRA policy; `grpo.vllm`: its order
of the sampling filters), then the launch (`grpo.infra.distributed.check_launch`; a 4-bit
base in one process), then the packages the run's engines need (`check_installed`: vLLM, the
8-bit optimizer's, the 4-bit base's).

`grpo.config` checks every value and combination of the config's own and imports no engine
(it stands below them); the checks that ask an engine are here, each a row of
`grpo.refusals` raised as its one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.config import Config
from grpo.errors import UserError
from grpo.infra.distributed import check_launch
from grpo.refusals import refuse
from grpo.rollout.decoders import fast_only_refusal, lora_refusal
from grpo.train.models import quantize_missing
from grpo.train.optimizers import missing as optimizer_missing
from grpo.vllm import missing as vllm_missing
from grpo.vllm import unsupported

if TYPE_CHECKING:
    import torch


def check_sampler(c: Config) -> None:
    """What the decoder rollout.sampler names cannot do with `c` (auto's choice is known once
    the model is: the Sampler says then), as one line."""
    ro = c.rollout
    refused = fast_only_refusal(ro, ro.sampler)
    if refused is None and ro.sampler == "vllm":
        refused = unsupported(ro)  # an option vLLM cannot sample as the other decoders do
    if refused is None and c.lora.r > 0:
        refused = lora_refusal(ro.sampler)
    if refused is not None:
        raise UserError(refused)


def check_installed(c: Config) -> None:
    """A package the run's engines need that this environment lacks, as one line with its
    install: vLLM where rollout.sampler is vllm in this process (a vLLM server's run needs
    none here), bitsandbytes for train.optimizer adamw_8bit, bitsandbytes and accelerate for
    lora.quantize."""
    absent = vllm_missing() if c.rollout.sampler == "vllm" and not c.rollout.vllm.server else None
    absent = absent or optimizer_missing(c.train.optimizer)
    absent = absent or quantize_missing(c.lora.quantize)
    if absent is not None:
        raise UserError(absent)


def preflight(c: Config, world_size: int, device: torch.device) -> str:
    """Every check of `c` that needs an engine's facts, then the launch's, then the packages
    the engines need; returns the process group's backend. Runs in every process from the
    config and the environment alone, so that all reach the same verdict before any waits for
    another or loads a model."""
    check_sampler(c)
    if world_size > 1 and c.lora.quantize != "none":
        refuse("quantize+torchrun", world_size=world_size)
    backend = check_launch(
        world_size,
        device,
        backend=c.train.backend,
        device_setting=c.train.device,
        prompts_per_step=c.rollout.prompts_per_step,
        optimizer=c.train.optimizer,
        optimizer_in_backward=c.train.optimizer_in_backward,
        server_and_async=bool(c.rollout.vllm.server) and c.rollout.async_.max_staleness > 0,
    )
    check_installed(c)
    return backend
