"""Sampling G completions per prompt, and the batch type that carries them through a step."""

from grpo.rollout.batch import Rollout
from grpo.rollout.sampler import HFSampler, Sampler, prompt_text

__all__ = ["HFSampler", "Rollout", "Sampler", "prompt_text"]
