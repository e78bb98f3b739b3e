"""argparse value types shared by the commands: a bad value is one line from argparse."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def digit_list(text: str) -> int | list[int]:
    """One positive integer ('3'), or several comma-separated ('2,3') as a list."""
    values = [positive_int(part.strip()) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


DEVICE_HELP = "auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N (default: %(default)s)"
