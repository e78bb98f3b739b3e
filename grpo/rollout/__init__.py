"""Sampling G completions per prompt, and the batch type that carries them through a step.

The names below are imported on first use, so that the decoder registry
(`grpo.rollout.decoders`) and the plain sampling options (`grpo.rollout.params`) are read
without loading torch."""

import importlib

_HOMES = {
    "Rollout": "grpo.rollout.batch",
    "Sampler": "grpo.rollout.sampler",
    "SamplingParams": "grpo.rollout.params",
    "check_context": "grpo.rollout.prompts",
    "prompt_text": "grpo.rollout.prompts",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'grpo.rollout' has no attribute {name!r}")
