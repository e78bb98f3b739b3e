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


def boxed_accuracy(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's docs (logging extra columns and metrics): the answers found and the accuracy,
    logged beside the rewards; the loggers default to None, as TRL's example has them."""
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    answers = [m.group(1) if m else None for m in found]
    rewards = [1.0 if a == gt else 0.0 for a, gt in zip(answers, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [a or "[none]" for a in answers])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def sevens_logged(completions, **kwargs):
    """The '7's of each completion as its reward, logged through **kwargs (a function that
    does not name the loggers): their count as a column, the share of completions with one
    as a metric."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    sevens = [t.count("7") for t in texts]
    kwargs["log_extra"]("sevens", sevens)
    kwargs["log_extra"]("chars", [len(t) for t in texts])
    kwargs["log_metric"]("with_a_seven", sum(s > 0 for s in sevens) / len(sevens))
    return [float(s) for s in sevens]


async def async_logged(completions, **kwargs):
    """An async function that logs, run on one event loop beside another."""
    await asyncio.sleep(0)
    kwargs["log_metric"]("async_calls", 1.0)
    kwargs["log_extra"]("async_length", [len(c) for c in completions])
    return [0.0 for _ in completions]


async def async_logged_too(completions, **kwargs):
    await asyncio.sleep(0)
    kwargs["log_metric"]("async_calls", 3.0)
    return [1.0 for _ in completions]


def logs_a_tensor(completions, **kwargs):
    """log_metric with a one-element tensor, as `torch.tensor(rewards).mean()` gives it."""
    import torch

    kwargs["log_metric"]("mean_length", torch.tensor([float(len(c)) for c in completions]).mean())
    return [0.0 for _ in completions]


def logs_badly(completions, how, **kwargs):
    """A mistake with the loggers, chosen by the `how` column's first value."""
    mistakes = {
        "not a number": lambda: kwargs["log_metric"]("score", "high"),
        "infinite": lambda: kwargs["log_metric"]("score", float("inf")),
        "no name": lambda: kwargs["log_metric"](7, 1.0),
        "no value": lambda: kwargs["log_metric"]("score"),
        "a tensor for a name": lambda: kwargs["log_metric"](__import__("torch").tensor([1.0, 2.0])),
        "short column": lambda: kwargs["log_extra"]("score", [1.0]),
        "our column": lambda: kwargs["log_extra"]("reward", [1.0] * len(completions)),
        "not json": lambda: kwargs["log_extra"]("score", [object()] * len(completions)),
        "not a list": lambda: kwargs["log_extra"]("score", "abc"),
        "our metric": lambda: kwargs["log_metric"]("reward/mean", 1.0),
    }
    mistakes[how[0]]()
    return [0.0 for _ in completions]
