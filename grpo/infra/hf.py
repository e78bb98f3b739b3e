"""Quieting transformers where its output is expected noise."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def quiet_loading():
    """Silence transformers' load report while building a model from another head's
    checkpoint (a backbone from a causal LM, a classifier from a causal LM): its table of
    "missing" and "unexpected" keys is then the expected outcome, not a problem."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
