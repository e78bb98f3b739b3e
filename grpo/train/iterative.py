"""Iterative RL (DeepSeekMath §4.1.4): the reward model keeps learning from the policy
(docs/reward-models.md).

Between outer iterations the policy's fresh samples, drawn by the run's generator, are
labelled by a verifier the user names; within a prompt's samples a higher-scored completion
is preferred over a lower-scored one. The reward model trains on these comparisons plus a
replay of a fraction (10% by default) of all earlier ones, following the policy without
forgetting.

Under torchrun each process samples and labels its part of the prompts (whole groups); the
labelled samples are gathered to every process, which builds the same pairs and replays the
same history (so the history and a checkpoint are the whole run's), and the reward model's
replicas learn data parallel (`RewardModel.fit`, gradients summed): identical by
construction, each process running its share.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from grpo.data import PromptStream
from grpo.infra.distributed import SingleProcess, World, part
from grpo.rewards import WeightedReward, score
from grpo.rewards.model import RewardModel
from grpo.rollout.generator import PAIRS, Generator


def comparisons(
    prompts: list,
    completions: list[str],
    labels: list[float],
    group_size: int,
    max_pairs: int,
    rng: random.Random,
) -> list[dict]:
    """Pairs (chosen, rejected) within each prompt's group: chosen scored strictly higher."""
    pairs = []
    for g in range(0, len(completions), group_size):
        members = range(g, g + group_size)
        ordered = [(i, j) for i in members for j in members if labels[i] > labels[j]]
        for i, j in rng.sample(ordered, min(max_pairs, len(ordered))):
            pairs.append({"prompt": prompts[i], "chosen": completions[i], "rejected": completions[j]})
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
    world: World = field(default_factory=SingleProcess)

    def update(self, policy, version: int, generator: Generator) -> dict:
        """Train the reward model on `samples_per_prompt` completions per prompt of `policy`
        (at `version`), drawn by the run's generator (its "pairs" sampler; published first
        where it holds older weights): this process's part of the prompts (module doc)."""
        if generator.published != version:
            generator.publish(policy, version)
        rows = self.prompts.take(self.prompts_per_update)  # the same rows in every process
        self.updates += 1
        generator.request(self.updates, rows[part(len(rows), self.world.rank, self.world.world_size)], None, PAIRS)
        batch = generator.take(self.updates, PAIRS)  # in every process, of no rows too (sampling is collective)
        prompts = [row[self.prompt_column] for row in batch.rows]
        columns = batch.reward_columns(exclude=self.prompt_column)
        # A verifier that fails in one process fails in all, so none waits for it in a collective.
        labels = self.world.checked(
            lambda: score([self.verifier], prompts, batch.scored_completions, columns).total.tolist() if prompts else []
        )
        return self.learn(prompts, batch.completions, labels)

    def learn(self, prompts: list, completions: list[str], labels: list[float]) -> dict:
        """Train the reward model on the comparisons within each group of this process's
        labelled samples (NaN: in no pair) and every other process's, gathered in rank order,
        plus a replay of the history; the update's statistics."""
        parts = self.world.gather_objects((prompts, completions, labels))
        prompts, completions, labels = ([x for p in parts for x in p[k]] for k in range(3))
        new = comparisons(prompts, completions, labels, self.samples_per_prompt, self.max_pairs_per_prompt, self.rng)
        replayed = self.rng.sample(self.history, round(self.replay * len(self.history)))
        seed = self.rng.randrange(2**31)  # a fresh order of the pairs at every update
        pairs = new + replayed
        losses = self.model.fit(pairs, seed=seed, progress=False, world=self.world, **self.fit_kwargs) if pairs else []
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
