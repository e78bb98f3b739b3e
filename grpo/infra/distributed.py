"""Many processes, one program: torch.distributed under torchrun, FSDP2, reductions.

`grpo train` is the same program in one process and under
`torchrun [--nnodes M ...] --nproc_per_node N -m grpo train CONFIG`. What differs is behind
a `World`: `SingleProcess` (the null object: every reduction is the identity, nothing is
sharded) or `ProcessGroup` (torch.distributed; NCCL on GPUs, gloo on CPUs). The step calls
the same methods in both and never asks which it has.

Data parallel, with the trained models sharded (FSDP2, `torch.distributed.fsdp.fully_shard`):
- each process samples `prompts_per_step / world_size` prompts and all G completions of
  each (a group never spans processes) and scores its own rows;
- the policy and the critic are sharded layer by layer: parameters, gradients and
  AdamW's state; each forward/backward all-gathers a layer's weights and reduce-scatters
  its gradients. Gradients are *summed* over processes (`set_gradient_divide_factor(1)`):
  every process divides its loss by the whole batch's counts (sequences, tokens), so the
  sum of the processes' gradients is the single-process gradient on the same rollouts;
- for sampling and the no-grad passes the sharded models are gathered whole (`gathered`):
  decoding runs a different number of forward passes in each process (rows stop at EOS),
  which sharded forwards (one collective per layer and pass) cannot; gathered, a forward
  runs no collective. This holds a full copy of the weights during sampling, as inference
  engines beside FSDP trainers do;
- the reference model and reward models are replicated (each process holds a full copy):
  they only run forward, on each process's own rows, so replicas need no communication,
  and a reference copy can be stored in bf16 (half the memory). Sharded, the reference's
  pass all-gathers every block (slower than a replica's: benchmarks/README.md,
  `bench_reference_sharding.py`), to save memory that the policy's AdamW state dwarfs.
  Iterative RL trains a reward model between iterations: its replicas learn data parallel
  (`sum_gradients`, as DistributedDataParallel), so they stay the same.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo.errors import UserError, first_line
from grpo.refusals import refuse


def launched_world_size() -> int:
    """The number of processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SingleProcess:
    """One process: reductions are the identity, models are not sharded."""

    rank = 0
    world_size = 1
    is_main = True

    def sum(self, x: Tensor) -> Tensor:
        return x

    def max(self, x: Tensor) -> Tensor:
        return x

    def gather(self, x: Tensor) -> tuple[Tensor, int]:
        """Every process's rows of `x` (sizes may differ), in rank order, and where ours start."""
        return x, 0

    def gather_objects(self, obj) -> list:
        return [obj]

    def sum_gradients(self, parameters) -> None:
        pass

    def barrier(self) -> None:
        pass

    def shard(self, model: nn.Module) -> nn.Module:
        return model

    @contextlib.contextmanager
    def gathered(self, *models: nn.Module):
        yield

    def full_state_dict(self, model: nn.Module, main_only: bool = False) -> dict:
        return model.state_dict()

    def checked(self, check):
        """Run `check` (which may raise UserError) in every process; see ProcessGroup.checked."""
        return check()

    def from_main(self, work):
        """`work()`, done once for every process; see ProcessGroup.from_main."""
        return work()

    def close(self) -> None:
        pass


@dataclass
class ProcessGroup:
    """torch.distributed's default process group, as torchrun set it up."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _on_device(self, x: Tensor) -> Tensor:
        return x.to(self.device) if self.device.type == "cuda" else x

    def _all_reduce(self, x: Tensor, op: str) -> Tensor:
        """`x` reduced by `op` ("SUM", "MAX") over every process (a new tensor, on x's device)."""
        import torch.distributed as dist

        out = self._on_device(x.detach().clone())
        dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
        return out.to(x.device)

    def sum(self, x: Tensor) -> Tensor:
        return self._all_reduce(x, "SUM")

    def max(self, x: Tensor) -> Tensor:
        return self._all_reduce(x, "MAX")

    def gather(self, x: Tensor) -> tuple[Tensor, int]:
        """Every process's rows of `x` concatenated in rank order (their numbers of rows may
        differ), and the row where this process's rows start."""
        import torch.distributed as dist

        sizes = [self._on_device(torch.zeros(1, dtype=torch.long)) for _ in range(self.world_size)]
        dist.all_gather(sizes, self._on_device(torch.tensor([x.shape[0]])))  # a tensor, not a pickled object
        sizes = [int(n) for n in sizes]
        width = max(sizes)
        padded = self._on_device(torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device))
        padded[: x.shape[0]] = self._on_device(x.detach())
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        everyone = torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)
        return everyone, sum(sizes[: self.rank])

    def gather_objects(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_gradients(self, parameters) -> None:
        """Each parameter's gradient summed over every process, in place: data parallel for a
        model replicated in each (a reward model), as DistributedDataParallel does; a process
        without a gradient (no rows of the batch) adds zeros. Every process gets the same sum,
        so replicas that take the same optimizer step stay the same."""
        for p in parameters:
            p.grad = self.sum(p.grad if p.grad is not None else torch.zeros_like(p))

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def shard(self, model: nn.Module) -> nn.Module:
        """FSDP2: each transformer block its own unit (all-gathered just before it runs and
        freed after), then the rest (embeddings, final norm, head) as the root unit.
        Gradients are summed, not averaged, over processes (see the module doc)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # LoRA: the root is the transformers model inside peft's wrapper, which every forward
        # (the adapters on or off) and `generate` enter; FSDP2 needs its root to run first.
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        blocks = set(getattr(root, "_no_split_modules", None) or [])
        for module in root.modules():
            inner = getattr(module, "backbone", None)  # the critic: blocks of its backbone
            if inner is not None:
                blocks |= set(getattr(inner, "_no_split_modules", None) or [])
        for module in list(root.modules()):
            if type(module).__name__ in blocks:
                fully_shard(module)
        fully_shard(root)
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)  # sum: each loss is already divided by the whole batch's counts
                unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
        return model

    @contextlib.contextmanager
    def gathered(self, *models: nn.Module):
        """The sharded `models` whole in every process for the duration: forwards run no
        collective, so processes may run different numbers of them (decoding)."""
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self._gathered(model))
            yield

    @contextlib.contextmanager
    def _gathered(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
                # FSDP2's own choice: blocks reshard after their forward, the root does not.
                unit.set_reshard_after_forward(unit is not units[0], recurse=False)

    def full_state_dict(self, model: nn.Module, main_only: bool = False) -> dict:
        """The whole model's weights as plain tensors: in every process (e.g. to reset a
        replica), or with `main_only` in process 0's CPU memory (empty elsewhere; to save)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=main_only)
        return get_model_state_dict(model, options=options)

    def checked(self, check):
        """Run `check` in every process; if it raised UserError in any, raise it in all (the
        first failing process's message), so that every process exits and none waits in a
        collective for one that stopped."""
        try:
            result, error = check(), None
        except UserError as err:
            result, error = None, str(err)
        errors = [e for e in self.gather_objects(error) if e is not None]
        if errors:
            raise UserError(errors[0])
        return result

    def from_main(self, work):
        """`work()` run in process 0 alone (what one process does for all: a push to a shared
        server), its result (picklable) returned in every process once it is done. Should it
        raise, every process raises: process 0 its error, the others a UserError with its line
        (a RuntimeError naming it when it was not a UserError), so that none goes on to wait
        in a collective for process 0, and the loop saves (or not) alike in all."""
        import torch.distributed as dist

        result, error, said = None, None, None
        if self.is_main:
            try:
                result = work()
            except Exception as err:
                error = err
                said = (
                    (True, str(err))
                    if isinstance(err, UserError)
                    else (False, f"{type(err).__name__}: {first_line(err)}")
                )
        sent = [(result, said)]
        dist.broadcast_object_list(sent, src=0)
        if error is not None:
            raise error
        result, said = sent[0]
        if said is not None:
            user, line = said
            raise UserError(line) if user else RuntimeError(f"process 0 failed: {line}")
        return result

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


World = SingleProcess | ProcessGroup


def part(n: int, rank: int, world_size: int) -> slice:
    """Process `rank`'s contiguous part of `n` items split over `world_size` processes in rank
    order: sizes differ by at most one, and a part is empty when n < world_size (a step's
    prompts, iterative RL's, a reward-model batch's pairs)."""
    return slice(n * rank // world_size, n * (rank + 1) // world_size)


BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


def check_launch(
    world_size: int,
    device: torch.device,
    *,
    backend: str,
    device_setting: str,
    prompts_per_step: int,
    optimizer: str,
    optimizer_in_backward: bool,
    server_and_async: bool,
) -> str:
    """The backend for this launch (`backend`, train.backend; auto: NCCL on GPUs, gloo on
    CPUs); a UserError for a launch that cannot work (a row of `grpo.refusals`), from the
    run's train.device (`device_setting`), prompts per step, optimizer (and whether it steps
    in the backward), and whether a vLLM server samples ahead of the trainer. Runs before the
    process group exists, from these values and the environment alone, so every process
    reaches the same verdict and none waits for another (`grpo.train.preflight`)."""
    if backend == "nccl" and device.type != "cuda":
        refuse("nccl+cpu", device=device.type, setting=device_setting)
    if world_size == 1:
        return backend
    if prompts_per_step % world_size:
        refuse("torchrun+uneven-prompts", prompts=prompts_per_step, world_size=world_size)
    if optimizer == "adamw_8bit":
        refuse("adamw_8bit+torchrun", world_size=world_size)
    if optimizer_in_backward:
        refuse("in-backward+torchrun", world_size=world_size)
    if server_and_async:
        refuse("async+server+torchrun", world_size=world_size)
    return BACKENDS[device.type] if backend == "auto" else backend


def init_world(device: torch.device, backend: str, *, timeout_minutes: float = 30.0) -> World:
    """SingleProcess without torchrun; otherwise join torchrun's process group."""
    world_size = launched_world_size()
    if world_size == 1:
        return SingleProcess()
    import torch.distributed as dist

    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes), **kwargs)
    return ProcessGroup(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)
