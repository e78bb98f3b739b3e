"""The tests' workload, for the benchmarks that time whole runs: a character-level Llama built
from a config (tests/conftest.py's alphabet and prompts), saved as a Hugging Face directory,
and a GRPO config on it with the tests' learnable reward (the fraction of '7's)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = ["a", "b", "c", "ab", "ba", "cab", "abc", "cc"]


def tests_workload(
    directory: Path,
    *,
    hidden: int,
    layers: int,
    prompts: int = 4,
    group_size: int = 8,
    max_new_tokens: int = 8,
    steps: int = 40,
) -> dict:
    """Build the model and prompts under `directory`; return the run's config (no output_dir).
    Every completion is exactly max_new_tokens long (EOS suppressed): every step the same work."""
    from grpo.tasks.tiny import save_tiny_model

    model = save_tiny_model(directory / "model", "0123456789abc ", hidden_size=hidden, layers=layers, heads=4)
    data = directory / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return {
        "algorithm": "grpo",
        "model": str(model),
        "seed": 0,
        "data": {"path": str(data)},
        "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
        "rollout": {
            "group_size": group_size,
            "prompts_per_step": prompts,
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": max_new_tokens,
        },
        "train": {"steps": steps, "lr": 1e-3, "sample_every": 0, "device": "cpu"},
        "loss": {"beta": 0.04},
    }
