"""Sampling G completions per prompt, and the batch type that carries them through a step."""

from grpo.rollout.batch import Rollout
from grpo.rollout.sampler import Sampler, prompt_text

HFSampler = Sampler  # the old name, until grpo/demo.py moves over

__all__ = ["Rollout", "Sampler", "prompt_text"]
