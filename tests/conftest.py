import json
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

from grpo.rewards.model import RewardModel
from grpo.tasks.tiny import save_tiny_model

# Property tests draw shapes and seeds; tensors come from a seeded torch generator.
settings.register_profile("default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

torch.set_num_threads(1)  # tiny models: per-op overhead, not arithmetic; and robust when another process holds a core

ALPHABET = "0123456789abc "


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with a character tokenizer, saved as a Hugging Face directory."""
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), ALPHABET, hidden_size=64, layers=2, heads=4))


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": p, "tag": i}) + "\n"
            for i, p in enumerate(["a", "b", "c", "ab", "ba", "cab", "abc", "cc"])
        )
    )
    return str(path)


@pytest.fixture
def make_config(tiny_model, prompts_file, tmp_path):
    """A small, fast config; keyword arguments are --set style overrides."""

    def make(algorithm="grpo", **sections):
        config = {
            "algorithm": algorithm,
            "model": tiny_model,
            "seed": 0,
            "output_dir": str(tmp_path / "run"),
            "data": {"path": prompts_file},
            "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
            "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
            "train": {"steps": 4, "lr": 1e-3, "sample_every": 2},
            "loss": {"beta": 0.04},
        }
        if algorithm == "ppo":
            config["rollout"].update(group_size=1, prompts_per_step=8)
        for section, values in sections.items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        return config

    return make


CHARS = "0123456789abc "


def sevens_pairs(n, seed):
    """Comparisons whose chosen completion has more '7's in its first 8 characters."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        k = rng.randint(1, 8)
        chosen = [rng.choice(CHARS.replace("7", "")) for _ in range(8)]
        for i in rng.sample(range(8), k):
            chosen[i] = "7"
        rejected = [rng.choice(CHARS.replace("7", "")) for _ in range(8)]
        for i in rng.sample(range(8), rng.randint(0, k - 1)):
            rejected[i] = "7"
        pairs.append(
            {"prompt": rng.choice(["a", "b", "c", "ab"]), "chosen": "".join(chosen), "rejected": "".join(rejected)}
        )
    return pairs


@pytest.fixture(scope="session")
def sevens_rm(tiny_model, tmp_path_factory):
    """A reward model trained (from the tiny base) to prefer completions with more 7s."""
    directory = tmp_path_factory.mktemp("rm")
    rm = RewardModel.from_base(tiny_model, seed=0)
    rm.fit(sevens_pairs(400, seed=1), lr=1e-3, epochs=2, batch_size=16, progress=False)
    assert rm.evaluate(sevens_pairs(100, seed=2))["accuracy"] >= 0.9
    rm.save(directory / "model")
    history = directory / "history.jsonl"
    history.write_text("".join(json.dumps(p) + "\n" for p in sevens_pairs(40, seed=3)))
    return str(directory / "model"), str(history)
