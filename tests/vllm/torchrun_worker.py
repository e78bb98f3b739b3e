"""Run by tests/vllm/test_torchrun.py under torchrun: `grpo train CONFIG` in each process, with
every sample the vLLM engine draws scored by the trainer right there, and the gaps written down.

`python -m tests.vllm.torchrun_worker CONFIG OUT`: process r writes OUT/rank-r.json with, for
each sampling call, the largest |engine log-prob - trainer log-prob| over the tokens drawn and
how many tokens that was, the number of engines the process built, and whether torchrun's
process group was still there each time an engine was shut down (the run's generator's `close`). The trainer's log-probs
are grpo's own (`policy_logprobs`), taken inside `world.gathered(policy)` as the sampler is, so
under FSDP2 they come from the whole policy that the engine was synced to just before."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.rollout.sampler import Sampler
from grpo.train import loop
from grpo.train.layouts import policy_logprobs
from grpo.vllm import decoder as vllm_decoder
from grpo.vllm.engine import LocalEngine

calls = []
group_kept = []
sample = Sampler.sample
close = LocalEngine.close


def scored_sample(self, model, rows, *args, **kwargs):
    rollout = sample(self, model, rows, *args, **kwargs)
    with torch.no_grad():
        trainer = policy_logprobs(model, rollout, self.params.temperature, self.params.repetition_penalty)
    drawn = rollout.completion_mask.bool()
    gap = (rollout.sampled_logprobs[drawn] - trainer[drawn]).abs().max()
    calls.append({"max_gap": float(gap), "tokens": int(drawn.sum())})
    return rollout


def closed_engine(self):
    close(self)
    group_kept.append(dist.is_initialized())


def main(config: str, out: str) -> None:
    Sampler.sample = scored_sample
    LocalEngine.close = closed_engine
    loop.train(config, progress=False)
    record = {"calls": calls, "engines": vllm_decoder.BUILT["engines"], "group_kept": group_kept}
    (Path(out) / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
