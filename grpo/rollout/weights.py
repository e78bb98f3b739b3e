"""The policy's weights on their way to a sampler: what is sent, and how.

Every sampler gets its weights through `Generator.publish` (grpo.rollout.generator), and
what each kind of sampler needs is one `Publisher`: `InPlace` (our decoders in the trainer
read the policy's own tensors: nothing to copy), `EngineSync` (a vLLM engine, in this process
or a server's: the engine loads them and checks them, grpo.vllm), `SharedFile` (a generator
process: one file of a private folder, in memory where /dev/shm is, read by the worker,
grpo.rollout.worker). A NCCL broadcast would be one more class. What is sent is always
`policy_weights`: Hugging Face names, whole tensors, LoRA merged, so that a receiver never
needs to know how the trainer holds its model (sharded, adapted, its base in 4 bits).

The files travel through a private folder (`weights_folder`): in /dev/shm where it has room
for what the run sends, else the system's temporary folder, else a one-line refusal. A file's
bytes are reserved before it is mapped, so a full folder is an error, never a SIGBUS. Each
folder names its owner, and a run's start removes the folders of runs that are gone (docs/async.md).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from grpo.errors import UserError
from grpo.infra.space import no_space


def base_model(policy):
    """The transformers model under a peft wrapper (the policy itself when there is none)."""
    get = getattr(policy, "get_base_model", None)
    return get() if callable(get) else policy


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an FSDP2 shard (DTensor) gathered whole, autograd detached."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def _dequantized(param) -> torch.Tensor:
    """A 4-bit weight (lora.quantize: bitsandbytes' packed bytes with their quantization
    state) as the float tensor its layer computes with, in the dtype it was loaded in; any
    other weight whole (`_full`)."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return _full(param)
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(param.data, state)


def policy_weights(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as a model without adapters holds them: Hugging Face names,
    whole tensors (an FSDP2 shard gathered; a 4-bit weight dequantized), the head added under
    `lm_head.weight` when it is tied to the embedding (vLLM's tied head is only rebuilt when
    it is sent too), and a LoRA policy's adapted layers merged (W + scale * B @ A, computed,
    the model left as it is) under the base model's names: a QLoRA policy's merge is made in
    the dequantized weights, never in 4 bits. Read lazily; inside `world.gathered(policy)`
    they are views of the gathered weights, freed when the gathering ends: consume them there."""
    model = base_model(policy)
    lora = {  # peft's LoRA layers: the base layer's weight gets the adapter's delta
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")
    }
    names = set()
    for name, param in model.named_parameters():
        if _adapter(name):
            continue
        owner, _, leaf = name.rpartition(".")
        tensor = _dequantized(param)
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


def _adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter's (merged into its layer's weight, not sent)."""
    return ".lora_" in name or "lora_" in name.rsplit(".", 1)[-1]


def weights_bytes(policy) -> int:
    """The bytes `policy_weights` sends, from the parameters' shapes (nothing gathered): what
    a folder must hold for one version (a tied head counted once, as it is written once)."""
    return sum(_sent_bytes(p) for name, p in base_model(policy).named_parameters() if not _adapter(name))


def _sent_bytes(param) -> int:
    """The bytes of `param` as `policy_weights` sends it: a 4-bit weight dequantized."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        return math.prod(state.shape) * state.dtype.itemsize
    return math.prod(param.shape) * param.element_size()


ROOM = "give /dev/shm more (docker run --shm-size), or point TMPDIR at a folder with room"  # what to change
PREFIX = "grpo-weights-"  # the folders `weights_folder` makes, and `sweep` removes
OWNER = "owner.json"  # a folder's owner: the process that made it, for `sweep`


def places() -> list[str]:
    """Where a folder of files in transit may go, best first: /dev/shm (memory) where it
    exists, then the system's temporary folder ($TMPDIR)."""
    return (["/dev/shm"] if os.path.isdir("/dev/shm") else []) + [tempfile.gettempdir()]


def free_bytes(place: str) -> int:
    """The bytes this user may still write in the file system of `place`."""
    stats = os.statvfs(place)
    return stats.f_bavail * stats.f_frsize


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def weights_folder(need: int = 0, setting: str = "rollout.async") -> str:
    """A fresh private folder for files in transit (`need` bytes of them at once, at most):
    in the first of `places` with room, the fallback said once on stderr; a UserError naming
    what to change (`setting`: the option that sends them) where none has room. Folders of
    runs that are gone are swept first."""
    sweep()
    candidates = places()
    free = {place: free_bytes(place) for place in candidates}
    fits = [place for place in candidates if free[place] >= need]
    if not fits:
        room = " nor ".join(f"{place} ({_megabytes(free[place])} free)" for place in candidates)
        raise UserError(
            f"{setting}: the weights in transit need {_megabytes(need)} and neither {room} has room: {ROOM}"
        )
    if fits[0] != candidates[0]:
        print(
            f"grpo: {setting}: the weights in transit need {_megabytes(need)}, {candidates[0]} has "
            f"{_megabytes(free[candidates[0]])} free: they go through {fits[0]} instead (a bigger /dev/shm, "
            "e.g. docker run --shm-size, keeps them in memory)",
            file=sys.stderr,
        )
    folder = tempfile.mkdtemp(prefix=PREFIX, dir=fits[0])
    owner = os.path.join(folder, OWNER + ".part")
    with open(owner, "w") as f:
        json.dump({"pid": os.getpid(), "started": _started(os.getpid()), "host": _host()}, f)
    os.replace(owner, os.path.join(folder, OWNER))  # whole, or absent: a folder without one is never swept
    return folder


def _started(pid: int) -> str | None:
    """When process `pid` started (Linux: /proc/PID/stat's 22nd field, in clock ticks since
    boot), which a later process given the same pid does not share; None where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _host() -> str:
    """This machine and pid namespace: a folder another container or machine shares with us
    names pids we cannot see, and is left alone."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}"


def _alive(pid: int, started: str | None) -> bool:
    """Whether process `pid`, started at `started` (None: unknown), still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return started is None or _started(pid) in (None, started)


def sweep(where: list[str] | None = None) -> list[str]:
    """Remove the folders `weights_folder` made in `where` (default `places`) whose owner is
    gone (both processes of a run killed leave theirs behind): this user's, whose owner file
    names a process of this machine that no longer runs. Returns those removed."""
    removed = []
    for place in places() if where is None else where:
        for folder in Path(place).glob(PREFIX + "*"):
            try:
                if folder.stat().st_uid != os.getuid():
                    continue
                owner = json.loads((folder / OWNER).read_text())
                if owner["host"] != _host() or _alive(int(owner["pid"]), owner["started"]):
                    continue
            except (OSError, ValueError, KeyError, TypeError):
                continue  # no owner file (being made, or an older run's), or not ours to judge
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


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


def _reserve(path: str, size: int) -> None:
    """A file of `size` bytes at `path` whose blocks are allocated: writing into its mapping
    then cannot fault (a mapped write past a full tmpfs is a SIGBUS); a full folder raises
    OSError (ENOSPC) here instead."""
    with open(path, "wb") as f:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(f.fileno(), 0, size)
        else:  # no fallocate (macOS): zeros written, which a full disk refuses alike
            chunk = bytes(min(size, 16 << 20))
            for start in range(0, size, len(chunk) or 1):
                f.write(chunk[: size - start])


def write_weights(
    path: str, weights, wait: Callable[[OSError], None] | None = None
) -> tuple[list[tuple], dict[str, str]]:
    """`weights` ((name, tensor) pairs) copied once, straight into a new file at `path`
    (mapped: in memory when the folder is /dev/shm, its bytes reserved first); a tensor that
    is another's (a tied head) is written once. Where the folder has no room, `wait(error)`
    returns when it may have (it is tried again) or raises; without it the OSError rises.
    Returns what `read_weights` takes: the layout, (name, dtype, shape, byte offset) per
    tensor, and the aliases, name -> the name written for it."""
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
    while True:
        try:
            _reserve(path, max(size, 1))
            break
        except OSError as err:
            if os.path.exists(path):
                os.unlink(path)
            if wait is None or no_space(err) is None:
                raise
            wait(err)
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
    private folder (`write_weights`; `wait` where it is full), whose name and layout `send`
    passes on; the reader unlinks it. The trainer goes on changing its own tensors meanwhile."""

    def __init__(self, folder: str, send, wait: Callable[[OSError], None] | None = None):
        self.folder, self.send, self.wait, self.count = folder, send, wait, 0

    def publish(self, policy, version: int) -> None:
        self.count += 1
        path = os.path.join(self.folder, f"weights-{self.count}.bin")
        layout, aliases = write_weights(path, policy_weights(policy), self.wait)
        self.send(("weights", version, path, layout, aliases))

    def unread(self) -> int:
        """The versions written that the reader has not taken yet."""
        return len(list(Path(self.folder).glob("weights-*.bin")))
