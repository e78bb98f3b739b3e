"""Which batch each step trains on, and when the generator gets new weights.

The loop reads: take the step's batch, score it and learn from it, publish. `Rollouts`
owns the run's one prompt stream and keeps the run's Generator (grpo.rollout.generator)
`ahead` steps ahead: 0 in a synchronous run (the step's batch is sampled when the step
takes it, with the weights just published), and with rollout.async as many as keep every
batch within max_staleness optimizer steps of the weights it trains
(`grpo.config.lookahead`). A batch staler than that (a schedule beyond K, a late
generator) is dropped, counted, and sampled again with the current weights. The stream
runs ahead with the requests; the position a checkpoint keeps (`state_dict`) is that of
the first step not yet trained, so a resume requests the steps ahead again. Under torchrun
every process has its own generator and its share of each step's prompts: a group never
spans processes.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from grpo.config import Config, lookahead
from grpo.data import PromptStream
from grpo.infra.distributed import part
from grpo.infra.seed import prompt_seed
from grpo.rollout import Rollout
from grpo.rollout.generator import Generator
from grpo.train.step import Engine


def share_of(c: Config, rank: int, world_size: int, step: int, batch_rows: list[dict]):
    """This process's rows of a step's batch (a contiguous share of whole prompts) and, with
    rollout.seed_per_prompt, their seeds (by their index in the whole batch)."""
    ours = range(c.rollout.prompts_per_step)[part(c.rollout.prompts_per_step, rank, world_size)]  # an even split
    seeds = [prompt_seed(c.seed, step, i) for i in ours] if c.rollout.seed_per_prompt else None
    return [batch_rows[i] for i in ours], seeds


class Request(NamedTuple):
    """A step's batch as requested: this process's rows, their seeds, and the stream's
    position before the step's rows were taken (what a checkpoint of the steps before keeps)."""

    rows: list[dict]
    seeds: list[int] | None
    position: dict


class Rollouts:
    """The run's batches from `generator`, over the run's prompt stream (`rows`, shuffled by
    the seed and data.shuffle), on the schedule of the module doc. Built, then the stream
    restored from a checkpoint (`load_state_dict`), then `start`ed at the first step to
    train. With rollout.async every step's metrics gain async/staleness (the trained
    batch's), async/staleness_max (the stalest received in the step, dropped ones included),
    async/dropped, async/queue_wait_s, async/push_s and async/generator_wait_s (the
    generator idle before it sampled the batch)."""

    def __init__(self, c: Config, e: Engine, generator: Generator, rows: list[dict], *, ahead: int | None = None):
        a = c.rollout.async_
        self.c, self.generator, self.world = c, generator, e.world
        self.asynchronous = a.max_staleness > 0
        self.max_staleness = a.max_staleness
        self.push_every = a.push_every
        self.ahead = lookahead(c) if ahead is None else ahead  # `ahead`: a test's schedule, beyond what K allows
        self.stream = PromptStream(rows, seed=c.seed, shuffle=c.data.shuffle)
        self.requested: dict[int, Request] = {}
        self.next_request = 0

    def state_dict(self) -> dict:
        """The stream's position at the first step not yet trained (its rows not yet taken,
        or taken by a request ahead, which a resume makes again)."""
        return self.requested[min(self.requested)].position if self.requested else self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's position (`state_dict`'s), before `start`."""
        self.stream.load_state_dict(state)

    def start(self, e: Engine, step: int) -> Rollouts:
        """Publish the weights the generator starts from (a resume's, restored) and request
        step `step`'s batch and the `ahead` after it."""
        self.next_request = step
        self.generator.publish(e.policy, e.version)
        for _ in range(self.ahead + 1):
            self._request_next()
        return self

    def _request_next(self) -> None:
        step = self.next_request
        if step >= self.c.train.steps:
            return
        position = self.stream.state_dict()
        batch_rows = self.stream.take(self.c.rollout.prompts_per_step)
        rows, seeds = share_of(self.c, self.world.rank, self.world.world_size, step, batch_rows)
        self.requested[step] = Request(rows, seeds, position)
        self.generator.request(step, rows, seeds)
        self.next_request += 1

    def take(self, e: Engine, step: int) -> tuple[Rollout, dict]:
        """Step `step`'s batch, within K optimizer steps of the current weights, and what it
        cost: time/generate and, asynchronous, the async/ metrics. Over several processes the
        staleness that decides a drop is the largest."""
        rows, seeds, _ = self.requested[step]
        if not self.asynchronous and self.generator.published != e.version:
            self.generator.publish(e.policy, e.version)  # the step samples with the current weights
        waited, dropped, stalest = 0.0, 0, 0
        while True:
            start = time.perf_counter()
            rollout = self.generator.take(step)
            waited += time.perf_counter() - start
            staleness = e.version - rollout.policy_version  # optimizer steps the sampling weights lag
            if self.asynchronous and self.world.world_size > 1:
                staleness = int(self.world.max(torch.tensor([staleness])).item())
            stalest = max(stalest, staleness)
            if staleness <= self.max_staleness:
                break
            dropped += 1
            if self.generator.published != e.version:
                self.generator.publish(e.policy, e.version)
            self.generator.request(step, rows, seeds)  # the same rows and seeds, with the current weights
        del self.requested[step]
        seconds = self.generator.seconds
        if not self.asynchronous:
            return rollout, {"time/generate": seconds["generate"]}
        return rollout, {
            "time/generate": seconds["generate"],
            "async/staleness": staleness,
            "async/staleness_max": stalest,
            "async/dropped": dropped,
            "async/queue_wait_s": waited,
            "async/generator_wait_s": seconds["idle"],
        }

    def after_update(self, e: Engine) -> dict:
        """With rollout.async, publish the new weights when due (every push_every optimizer
        steps, unless no batch is requested after them) and request the next step; the push's
        metrics. A synchronous run publishes as the next step takes its batch (`take`), so that
        a failed publish (a vLLM server gone) fails that step, not the one just completed."""
        pushed = 0.0
        due = e.version - (self.generator.published or 0) >= self.push_every
        if self.asynchronous and due and self.next_request < self.c.train.steps:
            start = time.perf_counter()
            self.generator.publish(e.policy, e.version)
            pushed = time.perf_counter() - start
        self._request_next()
        return {"async/push_s": pushed} if self.asynchronous else {}

    def close(self) -> None:
        """Stop the generator; what it sampled ahead is discarded (a resume samples it again)."""
        self.generator.close()


def summary(metrics: list[dict]) -> dict:
    """A run's staleness and drops, for summary.json (empty for a synchronous run)."""
    if not metrics or "async/staleness" not in metrics[0]:
        return {}
    staleness = [m["async/staleness"] for m in metrics]
    return {
        "async": {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(m["async/staleness_max"] for m in metrics),
            "dropped": sum(m["async/dropped"] for m in metrics),
            "queue_wait_s": math.fsum(m["async/queue_wait_s"] for m in metrics),
        }
    }
