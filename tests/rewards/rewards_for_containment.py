"""Reward functions that misbehave, named by spec (an isolated reward is imported by its spec
in a worker process): tests/rewards/test_containment.py calls them."""

import asyncio
import os
import signal
import sys
import time

CALLS = {"n": 0}  # calls of `fails_on_bad` in this process
CANCELLED = []  # the tag of each cancelled call of `async_sleeps` in this process


class Stop(BaseException):
    """A custom BaseException, as some libraries raise to unwind."""


def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def with_columns(prompts, completions, target, level, **columns):
    """Uses every argument: the prompt's length, a match with `target`, and `level`."""
    return [len(p) + float(c == t) + lv for p, c, t, lv in zip(prompts, completions, target, level, strict=True)]


def echo(prompts, completions, value, **columns):
    """Returns the `value` column as the scores."""
    return list(value)


def sleeps(prompts, completions, seconds, pid_file=None, **columns):
    """Writes its process id to pid_file[0] (if given), then sleeps seconds[0]."""
    if pid_file:
        with open(pid_file[0], "w") as f:
            f.write(str(os.getpid()))
    time.sleep(seconds[0])
    return [1.0] * len(completions)


def exits(prompts, completions, code, **columns):
    sys.exit(code[0])


def interrupts(prompts, completions, **columns):
    raise KeyboardInterrupt


def generator_exit(prompts, completions, **columns):
    raise GeneratorExit


def stops(prompts, completions, **columns):
    raise Stop("unwound")


def dies(prompts, completions, **columns):
    os._exit(7)


def fails_on_bad(prompts, completions, **columns):
    """Raises when any completion is 'bad'; counts its calls in CALLS."""
    CALLS["n"] += 1
    if "bad" in completions:
        raise ValueError("a bad completion")
    return [1.0] * len(completions)


def mutates(prompts, completions, answer, meta, **columns):
    """Scores 1.0 each, after wrecking everything it was given."""
    n = len(completions)
    completions.clear()
    prompts.append("extra")
    prompts[0][0]["content"] = "changed"  # a chat prompt's message
    answer.reverse()
    meta[0]["seen"] = True  # a dict-valued column, shared by the rows of one data row
    meta[1]["tags"].append("new")
    return [1.0] * n


async def async_length(prompts, completions, **columns):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


async def async_sleeps(prompts, completions, seconds, tag=None, **columns):
    """Sleeps seconds[0], cooperatively; notes tag[0] in CANCELLED when it is cancelled instead."""
    try:
        await asyncio.sleep(seconds[0])
    except asyncio.CancelledError:
        CANCELLED.append(tag[0] if tag else None)
        raise
    return [1.0] * len(completions)


def ctrl_c(prompts, completions, **columns):
    """A real Ctrl-C in the middle of the call: the process sends itself SIGINT."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs here, on the main thread
    return [1.0] * len(completions)


def unpicklable(prompts, completions, **columns):
    return [lambda: 1.0 for _ in completions]


ORDER = []  # what the `interleaves_*` functions did, in order, in this process


async def interleaves_a(prompts, completions, **columns):
    """Notes its start, yields to the event loop once, notes its end."""
    ORDER.append("a starts")
    await asyncio.sleep(0)
    ORDER.append("a ends")
    return [1.0] * len(completions)


async def interleaves_b(prompts, completions, **columns):
    ORDER.append("b starts")
    await asyncio.sleep(0)
    ORDER.append("b ends")
    return [2.0] * len(completions)


async def async_exits(prompts, completions, **columns):
    await asyncio.sleep(0)
    sys.exit(3)
