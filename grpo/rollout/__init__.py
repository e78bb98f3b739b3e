"""Sampling G completions per prompt, and the batch type that carries them through a step."""

from grpo.rollout.batch import Rollout
from grpo.rollout.sampler import Sampler, check_context, prompt_text

__all__ = ["Rollout", "Sampler", "check_context", "prompt_text"]
