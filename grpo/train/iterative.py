"""Iterative RL (DeepSeekMath §4.1.4): the reward model keeps learning from the policy.

Between outer iterations the policy's fresh samples are labelled by a verifier the user
names; within each prompt's samples, a higher-scored completion is preferred over a
lower-scored one. The reward model then trains on these new comparisons plus a replay of
a fraction (10% by default) of all earlier comparisons, so it follows the policy's
distribution without forgetting what it knew.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from grpo.data import PromptStream
from grpo.rewards import WeightedReward, score
from grpo.rewards.model import RewardModel
from grpo.rollout.generator import PAIRS, Generator


def comparisons(
    rows: list[dict],
    completions: list[str],
    labels: list[float],
    group_size: int,
    prompt_column: str,
    max_pairs: int,
    rng: random.Random,
) -> list[dict]:
    """Pairs (chosen, rejected) within each prompt's group: chosen scored strictly higher."""
    pairs = []
    for g in range(0, len(completions), group_size):
        members = range(g, g + group_size)
        ordered = [(i, j) for i in members for j in members if labels[i] > labels[j]]
        for i, j in rng.sample(ordered, min(max_pairs, len(ordered))):
            pairs.append({"prompt": rows[i][prompt_column], "chosen": completions[i], "rejected": completions[j]})
    return pairs


@dataclass
class RewardModelUpdater:
    model: RewardModel
    verifier: WeightedReward
    prompts: PromptStream  # its own stream: the training stream's order is not disturbed
    prompt_column: str
    prompts_per_update: int
    samples_per_prompt: int
    max_pairs_per_prompt: int
    replay: float
    fit_kwargs: dict
    history: list[dict] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    updates: int = 0  # the reward model's updates so far (its batches' keys)

    def update(self, policy, version: int, generator: Generator) -> dict:
        """Train the reward model on `samples_per_prompt` completions per prompt of `policy`
        (at `version`), drawn by the run's generator (its "pairs" sampler; published first
        where it holds older weights)."""
        if generator.published != version:
            generator.publish(policy, version)
        rows = self.prompts.take(self.prompts_per_update)
        self.updates += 1
        generator.request(self.updates, rows, None, PAIRS)
        batch = generator.take(self.updates, PAIRS)
        prompts = [row[self.prompt_column] for row in batch.rows]
        columns = batch.reward_columns(exclude=self.prompt_column)
        labels = score([self.verifier], prompts, batch.scored_completions, columns).total
        new = comparisons(
            batch.rows,
            batch.completions,
            labels.tolist(),  # NaN: in no pair
            self.samples_per_prompt,
            self.prompt_column,
            self.max_pairs_per_prompt,
            self.rng,
        )
        replayed = self.rng.sample(self.history, round(self.replay * len(self.history)))
        seed = self.rng.randrange(2**31)  # a fresh order of the pairs at every update
        losses = self.model.fit(new + replayed, seed=seed, progress=False, **self.fit_kwargs) if new + replayed else []
        stats = {
            "new_pairs": len(new),
            "replayed": len(replayed),
            "history": len(self.history),
            "loss": sum(losses) / len(losses) if losses else None,
            "accuracy_on_new": self.model.evaluate(new)["accuracy"] if new else None,
        }
        self.history.extend(new)
        return stats

    def state_dict(self) -> dict:
        return {
            "model": self.model.model.state_dict(),
            "history": self.history,
            "rng": self.rng.getstate(),
            "prompts": self.prompts.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.model.load_state_dict(state["model"])
        self.history = list(state["history"])
        self.rng.setstate(state["rng"])
        self.prompts.load_state_dict(state["prompts"])
