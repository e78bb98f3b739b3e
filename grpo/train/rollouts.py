"""Which batch each step trains on, and when the generator gets new weights.

The loop reads: take the step's batch, score it and learn from it, publish. `Rollouts`
keeps the run's Generator (grpo.rollout.generator) `ahead` steps ahead: 0 in a synchronous
run (the step's batch is sampled when the step takes it, with the weights just published),
and with rollout.async as many as keep every batch within max_staleness optimizer steps of
the weights it trains (`grpo.config.lookahead`). A batch staler than that (a schedule beyond
K, a late generator) is dropped, counted, and sampled again with the current weights. The
steps ahead take their rows from a stream of their own, so the trainer's stream, and its
checkpoint, stays at the steps it trained. Under torchrun every process has its own
generator and its share of each step's prompts: a group never spans processes.
"""

from __future__ import annotations

import math
import time

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


class Rollouts:
    """The run's batches from `generator`, on the schedule of the module doc. With
    rollout.async every step's metrics gain async/staleness (the trained batch's),
    async/staleness_max (the stalest received in the step, dropped ones included),
    async/dropped, async/queue_wait_s, async/push_s and async/generator_wait_s (the
    generator idle before it sampled the batch)."""

    def __init__(
        self,
        c: Config,
        e: Engine,
        generator: Generator,
        stream: PromptStream,
        rows: list[dict],
        start: int,
        *,
        ahead: int | None = None,
    ):
        a = c.rollout.async_
        self.c, self.generator, self.world = c, generator, e.world
        self.asynchronous = a.max_staleness > 0
        self.max_staleness = a.max_staleness
        self.push_every = a.push_every
        self.ahead = lookahead(c) if ahead is None else ahead  # `ahead`: a test's schedule, beyond what K allows
        self.rows_ahead = PromptStream(rows, seed=c.seed, shuffle=c.data.shuffle)
        self.rows_ahead.load_state_dict(stream.state_dict())
        self.requested: dict[int, tuple[list[dict], list[int] | None]] = {}
        self.next_request = start
        self.generator.publish(e.policy, e.version)  # the weights it starts from (a resume's, restored)
        for _ in range(self.ahead + 1):  # this step and the `ahead` after it
            self._request_next()

    def _request_next(self) -> None:
        step = self.next_request
        if step >= self.c.train.steps:
            return
        batch_rows = self.rows_ahead.take(self.c.rollout.prompts_per_step)
        self.requested[step] = share_of(self.c, self.world.rank, self.world.world_size, step, batch_rows)
        self.generator.request(step, *self.requested[step])
        self.next_request += 1

    def take(self, e: Engine, step: int, rows: list[dict], seeds: list[int] | None) -> tuple[Rollout, dict]:
        """Step `step`'s batch (the rows the loop took, `rows`), within K optimizer steps of
        the current weights, and what it cost: time/generate and, asynchronous, the async/
        metrics. Over several processes the staleness that decides a drop is the largest."""
        assert self.requested[step] == (rows, seeds), "the batch requested ahead is not the step's"  # one stream
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
