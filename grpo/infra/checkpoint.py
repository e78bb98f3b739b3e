"""Resumable checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is written to a temporary directory and renamed into place, so a run killed
while saving leaves the previous checkpoint intact and never a half-written one.

One process writes `state.pt`. A run over several processes writes, in the same
directory, `shards/` (torch.distributed.checkpoint: each process writes its shard of the
sharded models and optimizer state), `rank-NNNNN.pt` per process (its random-number
state) and `state.pt` (what all processes share, and their number). It resumes with the
same number of processes; the directory must be on a filesystem that every node sees.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from grpo.errors import UserError

_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / "state.pt").is_file()]
    return [p for _, p in sorted(found)]


def save_checkpoint(output_dir: Path, step: int, state: dict, *, keep: int) -> Path:
    root = checkpoint_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_sharded_checkpoint(world, output_dir: Path, step: int, common: dict, local: dict, sharded: dict, *, keep: int) -> Path:
    """Every process calls this at the same step: `sharded` (a state dict of DTensors and
    plain tensors) goes to `shards/`, `local` to this process's own file, `common` (the
    same in every process) to `state.pt`, written last."""
    import torch.distributed.checkpoint as dcp

    root = checkpoint_dir(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    world.barrier()
    dcp.save(sharded, checkpoint_id=str(tmp / "shards"))
    torch.save(local, tmp / f"rank-{world.rank:05d}.pt")
    world.barrier()
    if world.is_main:
        torch.save({**common, "world_size": world.world_size}, tmp / "state.pt")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    world.barrier()
    return final


def load_latest_checkpoint(output_dir: Path, *, world_size: int = 1, rank: int = 0) -> dict:
    """The newest checkpoint's state; for a run over several processes also this process's
    own state (`local`) and where the shards are (`shards`, loaded once the models exist)."""
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise UserError(f"--resume: no checkpoint in {checkpoint_dir(output_dir)}")
    path = checkpoints[-1]
    # Our own file: it holds Python RNG state, so it is not a weights-only pickle.
    state = torch.load(path / "state.pt", weights_only=False)
    saved = state.get("world_size", 1)
    if saved != world_size:
        raise UserError(
            f"--resume: {path} was written by {saved} process(es) and this run has {world_size}; "
            f"resume with the same number of processes"
        )
    if world_size > 1:
        state["local"] = torch.load(path / f"rank-{rank:05d}.pt", weights_only=False)
        state["shards"] = str(path / "shards")
    return state
