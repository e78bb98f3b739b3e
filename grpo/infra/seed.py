"""Seeding and the random-number-generator state that a checkpoint carries."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prompt_seed(seed: int, step: int, index: int) -> int:
    """The seed of one prompt's sampling: a function of the run's seed, the step and the
    prompt's index in the step's whole batch (so not of which process samples it)."""
    return (((seed * 1_000_003) + step) * 1_000_033 + index) % 2**63


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn `turn` (0 = the first) of a multi-turn rollout whose prompt has the
    seed `seed` (rollout.seed_per_prompt): a fresh stream each turn, so that what one turn
    draws does not depend on how long the rows sampled beside it ran in the turn before."""
    return seed if turn == 0 else ((seed * 1_000_081) + turn) % 2**63


def sampling_seed(seed: int, rank: int, step: int) -> int:
    """The seed of one process's sampling at one step, without per-prompt seeds: a stream
    of its own, apart from the global one the update draws from, and the same on resume."""
    return (((seed * 1_000_037) + rank) * 1_000_039 + step) % 2**63


def rng_state() -> dict:
    """Every generator's state as tensors and plain tuples (a checkpoint loads with
    weights_only=True, so it holds no other object: numpy's key array becomes a tensor)."""
    kind, key, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(position), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.int64).astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
