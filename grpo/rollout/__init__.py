"""Sampling G completions per prompt, and the batch type that carries them through a step."""

from grpo.rollout.batch import Rollout
from grpo.rollout.sampler import Sampler, prompt_text

__all__ = ["Rollout", "Sampler", "prompt_text"]
