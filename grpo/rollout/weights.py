"""The policy's weights on their way to a sampler: what is sent, and how.

Every sampler gets its weights through `Generator.publish` (grpo.rollout.generator), and
what each kind of sampler needs is one `Publisher`: `InPlace` (our decoders in the trainer
read the policy's own tensors: nothing to copy), `EngineSync` (a vLLM engine, in this process
or a server's: the engine loads them and checks them, grpo.vllm), `SharedFile` (a generator
process: one file of a private folder, in memory where /dev/shm is, read by the worker,
grpo.rollout.worker). A NCCL broadcast would be one more class. What is sent is always
`policy_weights`: Hugging Face names, whole tensors, LoRA merged, so that a receiver never
needs to know how the trainer holds its model (sharded, adapted).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from typing import Protocol

import torch


def base_model(policy):
    """The transformers model under a peft wrapper (the policy itself when there is none)."""
    get = getattr(policy, "get_base_model", None)
    return get() if callable(get) else policy


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2 shard (DTensor) gathered whole, autograd detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def policy_weights(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as a model without adapters holds them: Hugging Face names,
    whole tensors (an FSDP2 shard gathered), the head added under `lm_head.weight` when it is
    tied to the embedding (vLLM's tied head is only rebuilt when it is sent too), and a LoRA
    policy's adapted layers merged (W + scale * B @ A, computed, the model left as it is)
    under the base model's names. Read lazily; inside `world.gathered(policy)` they are views
    of the gathered weights, freed when the gathering ends: consume them there."""
    model = base_model(policy)
    lora = {  # peft's LoRA layers: the base layer's weight gets the adapter's delta
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    names = set()
    for name, param in model.named_parameters():
        if ".lora_" in name or "lora_" in name.rsplit(".", 1)[-1]:
            continue
        owner, _, leaf = name.rpartition(".")
        tensor = _full(param)
        if owner.endswith(".base_layer") and owner.removesuffix(".base_layer") in lora:
            layer = lora[owner.removesuffix(".base_layer")]
            if leaf == "weight" and not getattr(layer, "merged", False):
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + _full(layer.get_delta_weight(adapter)).to(tensor.dtype)
            name = f"{owner.removesuffix('.base_layer')}.{leaf}"
        names.add(name)
        yield name, tensor
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        yield "lm_head.weight", _full(model.get_input_embeddings().weight)


def weights_folder() -> str:
    """A fresh private folder for weights (and batches) in transit: in /dev/shm (memory)
    where it exists, else the system's temporary folder."""
    return tempfile.mkdtemp(prefix="grpo-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


class Publisher(Protocol):
    """Puts a version of the policy's weights where one sampler reads them."""

    def publish(self, policy, version: int) -> None: ...


class InPlace:
    """Our decoders in the trainer's process read the policy's own tensors (the fast loop
    fuses its copy per version when it samples): there is nothing to send."""

    def publish(self, policy, version: int) -> None:
        pass


class EngineSync:
    """A vLLM engine's weights (this process's, or a server's through its file push): loaded
    from `policy_weights` and checked against the trainer's log-probs (rollout.vllm.check_sync)
    unless the engine holds this version already (the decoder's `prepare`)."""

    def __init__(self, decoder):
        self.decoder = decoder

    def publish(self, policy, version: int) -> None:
        self.decoder.prepare(policy, version)


# Tensors laid out in one weights file start at multiples of this (any dtype's alignment).
_ALIGN = 64


def write_weights(path: str, weights) -> tuple[list[tuple], dict[str, str]]:
    """`weights` ((name, tensor) pairs) copied once, straight into a new file at `path`
    (mapped: in memory when the folder is /dev/shm); a tensor that is another's (a tied head)
    is written once. Returns what `read_weights` takes: the layout, (name, dtype, shape, byte
    offset) per tensor, and the aliases, name -> the name written for it."""
    layout, aliases, first, tensors, size = [], {}, {}, [], 0
    for name, tensor in weights:
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if where in first:
            aliases[name] = first[where]
            continue
        first[where] = name
        size = -(-size // _ALIGN) * _ALIGN
        layout.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), size))
        tensors.append(tensor)
        size += tensor.numel() * tensor.element_size()
    mapped = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
    for (_, _, shape, offset), tensor in zip(layout, tensors):
        nbytes = tensor.numel() * tensor.element_size()
        mapped[offset : offset + nbytes].view(tensor.dtype).view(shape).copy_(tensor.detach())
    return layout, aliases


def read_weights(path: str, layout: list[tuple], aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors `write_weights` wrote at `path`, on a private mapping of it; the file is
    unlinked at once (the mapping stays readable, and its memory goes back when it is dropped)."""
    size = max(
        (offset + math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape, offset in layout), default=1
    )
    mapped = torch.from_file(path, shared=False, size=max(size, 1), dtype=torch.uint8)
    os.unlink(path)
    weights = {}
    for name, dtype, shape, offset in layout:
        kind = getattr(torch, dtype)
        weights[name] = mapped[offset : offset + math.prod(shape) * kind.itemsize].view(kind).view(shape)
    for name, written in (aliases or {}).items():
        weights[name] = weights[written]
    return weights


def load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """`weights` (what `policy_weights` sent) into `model`, a model without adapters of the
    same architecture: every parameter must be among them (buffers are the model's own)."""
    missing = [name for name, _ in model.named_parameters() if name not in weights]
    if missing:
        raise ValueError(f"the weights sent lack {len(missing)} of the model's parameters, e.g. {missing[0]}")
    model.load_state_dict(weights, strict=False)


class SharedFile:
    """A generator process's weights: `policy_weights` written into one file of the run's
    private folder (`write_weights`), whose name and layout `send` passes on; the reader
    unlinks it. The trainer goes on changing its own tensors meanwhile."""

    def __init__(self, folder: str, send):
        self.folder, self.send, self.count = folder, send, 0

    def publish(self, policy, version: int) -> None:
        self.count += 1
        path = os.path.join(self.folder, f"weights-{self.count}.bin")
        layout, aliases = write_weights(path, policy_weights(policy))
        self.send(("weights", version, path, layout, aliases))
