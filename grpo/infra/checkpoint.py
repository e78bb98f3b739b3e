"""Resumable checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is written to a temporary directory and renamed into place, so a run killed
while saving leaves the previous checkpoint intact and never a half-written one.
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


def load_latest_checkpoint(output_dir: Path) -> dict:
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise UserError(f"--resume: no checkpoint in {checkpoint_dir(output_dir)}")
    # Our own file: it holds Python RNG state, so it is not a weights-only pickle.
    return torch.load(checkpoints[-1] / "state.pt", weights_only=False)
