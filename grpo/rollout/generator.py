"""Producing rollouts: a Generator samples each requested batch with the weights last published.

The trainer speaks to one interface, whichever generator it has: `request` (a step's rows
and seeds), `take` (that step's Rollout, stamped with the version of the weights that drew
it), `publish` (the policy's weights after an update) and `close`. `LocalGenerator` samples
in this process when the step takes its batch; `grpo.rollout.worker.WorkerGenerator` samples
in a process of its own, ahead of the trainer (rollout.async). The worker builds a
LocalGenerator from the same `GeneratorSpec` (`build_generator` chooses), so tools,
environments and LoRA behave alike in both, and so do training's batches and iterative
RL's (the "pairs" purpose: its own group size, drawn from the global stream).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.infra.distributed import SingleProcess, World
from grpo.rollout.batch import Rollout
from grpo.rollout.decoders import Engines
from grpo.rollout.sampler import Sampler
from grpo.rollout.tools import Toolbox
from grpo.rollout.weights import EngineSync, InPlace, Publisher

TRAIN, PAIRS = "train", "pairs"  # what a batch is for: a training step, iterative RL's comparisons


class Generator(Protocol):
    """What the trainer asks of whatever produces its rollouts (module doc)."""

    published: int | None  # the version of the weights it was last given

    def request(self, step: int, rows: list[dict], seeds: list[int] | None = None, purpose: str = TRAIN) -> None: ...

    def take(self, step: int, purpose: str = TRAIN) -> Rollout: ...

    def start(self, policy) -> None: ...

    def publish(self, policy, version: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class GeneratorSpec:
    """What builds a generator's samplers, in the trainer or in a worker process (plain and
    picklable: tools and the environment as the config holds them, functions by reference)."""

    model: str  # the policy's directory or hub id (a worker loads it, then takes the trainer's weights)
    rollout: object  # a grpo.config.RolloutConfig
    prompt_column: str
    autocast: torch.dtype | None  # train.autocast, resolved
    seed: int
    rank: int = 0  # this process's rank (its sampling stream)
    pairs: int = 0  # iterative RL: completions per prompt of the reward model's samples (0: none)
    dtype: str = "float32"  # train.dtype: a worker's copy of the policy
    device: str = "cpu"
    threads: int = 1  # a worker's torch threads
    folder: str = ""  # a worker's private folder (weights and batches travel as its files)
    # Memory the fast loop may spend on packed weights: the gradients the update holds and a
    # sampling between updates does not (`grpo.train.assembly.sampling_room`); 0 in a worker.
    spare_bytes: int = 0

    @classmethod
    def of(cls, c, *, autocast, rank: int = 0, device: str = "cpu", spare_bytes: int = 0) -> GeneratorSpec:
        """The spec of run config `c` (a grpo.config.Config)."""
        u = c.reward_model_update
        return cls(
            model=c.model,
            rollout=c.rollout,
            prompt_column=c.data.prompt_column,
            autocast=autocast,
            seed=c.seed,
            rank=rank,
            pairs=u.samples_per_prompt if u.verifier else 0,
            dtype=c.train.dtype,
            device=device,
            threads=c.rollout.async_.threads,
            spare_bytes=spare_bytes,
        )


def samplers_of(
    spec: GeneratorSpec,
    tokenizer,
    tools: Toolbox | None,
    *,
    hold_prepared: bool = False,
    engines: Engines | None = None,
) -> dict[str, Sampler]:
    """The samplers of a generator, by purpose: training's (the run's seed and rank: its own
    stream per step) and, with iterative RL, the reward model's (its group size, no seed:
    the global stream, as before training had a generator). `hold_prepared`: a version's
    decoder work serves every batch it samples (a worker's, `Sampler`). `engines`: the
    generator's holder, through which they share one engine (None: each its own)."""
    common = dict(
        prompt_column=spec.prompt_column,
        autocast=spec.autocast,
        tools=tools,
        spare_bytes=spec.spare_bytes,
        hold_prepared=hold_prepared,
        engines=engines,
    )
    made = {TRAIN: Sampler.from_config(tokenizer, spec.rollout, seed=spec.seed, rank=spec.rank, **common)}
    if spec.pairs:
        made[PAIRS] = Sampler.from_config(tokenizer, spec.rollout, group_size=spec.pairs, **common)
    return made


def publisher_of(sampler: Sampler, policy) -> Publisher:
    """How `sampler` gets a version of the weights: its engine's sync (vLLM), or nothing to do."""
    if sampler.backend == "vllm":
        return EngineSync(sampler.decoder(policy, sampler.max_prompt_length))
    return InPlace()


class LocalGenerator:
    """Samples in this process, when a step takes its batch, with the policy object last
    published (the sharded policy gathered whole meanwhile). Nothing is ahead: a batch is
    always the current weights'. It owns the engine its samplers share (`engines`: vLLM's,
    built at `start`) and shuts it down at `close`, under torchrun while the process group
    is still there (the run closes its generator before its world)."""

    def __init__(self, samplers: dict[str, Sampler], world: World = SingleProcess(), engines: Engines | None = None):
        self.samplers, self.world = samplers, world
        self.engines = engines  # the holder its samplers were given (None: theirs, each closed with its sampler)
        self.policy, self.published = None, None
        self.publishers: dict[str, Publisher] = {}
        self.pending: dict[tuple[str, int], tuple[list[dict], list[int] | None]] = {}
        self.seconds = {"generate": 0.0, "idle": 0.0}  # what the last `take` cost

    @classmethod
    def of(
        cls, spec: GeneratorSpec, tokenizer, tools: Toolbox | None, world: World = SingleProcess(), **options
    ) -> LocalGenerator:
        """The generator of `spec`'s samplers (`samplers_of`, with `options`), sharing the
        engine it holds."""
        engines = Engines()
        return cls(samplers_of(spec, tokenizer, tools, engines=engines, **options), world, engines)

    def start(self, policy) -> None:
        """Build what the samplers build once (vLLM's engine; a server reached and admitted),
        so that what they refuse is known before the run writes anything."""
        if not self.publishers:
            for purpose, sampler in self.samplers.items():
                sampler.start(policy, self.world)
                self.publishers[purpose] = publisher_of(sampler, policy)

    def publish(self, policy, version: int) -> None:
        self.start(policy)
        self.policy, self.published = policy, version
        if any(not isinstance(p, InPlace) for p in self.publishers.values()):
            with self.world.gathered(policy):
                for publisher in self.publishers.values():
                    publisher.publish(policy, version)

    def request(self, step: int, rows: list[dict], seeds: list[int] | None = None, purpose: str = TRAIN) -> None:
        self.pending[(purpose, step)] = (rows, seeds)

    def take(self, step: int, purpose: str = TRAIN) -> Rollout:
        rows, seeds = self.pending.pop((purpose, step))
        start = time.perf_counter()
        sampler = self.samplers[purpose]
        with self.world.gathered(self.policy):  # a collective: entered by every process, with rows or none
            # A refusal in one process (a vLLM server gone: every process's) stops all, none left in a collective.
            rollout = self.world.checked(
                lambda: (
                    sampler.sample(self.policy, rows, seeds, step=step, version=self.published)
                    if rows
                    else Rollout.empty(sampler.group_size)
                )
            )
        rollout.policy_version = self.published  # the weights that drew it, whatever decoder drew it
        self.seconds = {"generate": time.perf_counter() - start, "idle": 0.0}
        return rollout

    def close(self) -> None:
        """Drop what was asked and not taken, and shut down the engine it holds (again: nothing)."""
        self.pending.clear()
        for sampler in self.samplers.values():
            sampler.close()
        if self.engines is not None:
            self.engines.close()
