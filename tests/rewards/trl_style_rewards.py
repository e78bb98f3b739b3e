"""Reward functions written the way TRL's GRPOTrainer documentation writes them (its
"Using a custom reward function" examples), plus ones that read completion_ids and
trainer_state, and an async one. `CALLS` records what each received."""

import asyncio
import re

CALLS: list[dict] = []


def reward_len(completions, **kwargs):
    """TRL's docs: prefer completions of about 20 characters (plain text completions)."""
    CALLS.append({"fn": "reward_len", "completions": completions, "kwargs": sorted(kwargs)})
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """TRL's docs, conversational: each completion is a list of messages."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    """TRL's docs: a dataset column (ground_truth) by name."""
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def length_in_tokens(completion_ids, **kwargs):
    CALLS.append({"fn": "length_in_tokens", "completion_ids": completion_ids})
    return [float(len(ids)) for ids in completion_ids]


def curriculum(completions, trainer_state, **kwargs):
    """Weights by training progress, as TRL users do with trainer_state."""
    CALLS.append({"fn": "curriculum", "global_step": trainer_state.global_step, "max_steps": trainer_state.max_steps})
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress for _ in completions]


async def async_reward(prompts, completions, **kwargs):
    """TRL accepts async reward functions (e.g. a remote judge)."""
    await asyncio.sleep(0)
    return [float(len(prompt[-1]["content"] if isinstance(prompt, list) else prompt)) for prompt in prompts]
