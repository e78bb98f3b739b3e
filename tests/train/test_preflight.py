"""The checks that need an engine's facts run in one place, `grpo.train.preflight`, from the
config and the environment alone (issue 57): a package the engines need and this environment
lacks is refused there, in one line, after what the config itself asks that an engine cannot
do, and before the process group or any model (the run's own message tests:
tests/train/test_vllm_missing.py, tests/train/test_optimizers.py)."""

import importlib.util

import pytest
import torch

from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.train.preflight import preflight

MINIMAL = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "exact_answer"}]}
VLLM_ABSENT = "rollout.sampler: vllm needs vLLM, which is not installed: "
BNB_ABSENT = "train.optimizer: adamw_8bit needs bitsandbytes, which is not installed: "


@pytest.fixture
def nothing_installed(monkeypatch):
    """Neither vLLM nor bitsandbytes, where they are installed too."""
    real = importlib.util.find_spec
    absent = {"vllm", "bitsandbytes"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name in absent else real(name, *a, **k)
    )


def check(*overrides: str) -> str | None:
    """preflight's one line for MINIMAL with `overrides`, or None where it passes."""
    try:
        preflight(config_from_dict(MINIMAL, list(overrides)), 1, torch.device("cpu"))
    except UserError as err:
        return str(err)
    return None


def test_a_missing_package_is_refused_before_any_model(nothing_installed):
    assert check() is None
    assert check("rollout.sampler=vllm").startswith(VLLM_ABSENT)
    assert check("rollout.sampler=vllm", "rollout.vllm.server=127.0.0.1:8000") is None  # the server holds vLLM
    assert check("train.optimizer=adamw_8bit").startswith(BNB_ABSENT)


def test_what_the_config_asks_that_an_engine_cannot_do_comes_first(nothing_installed):
    refused = check("rollout.sampler=vllm", "rollout.top_p=0.9", "rollout.min_p=0.1")
    assert refused.startswith("rollout.sampler: vllm applies min_p before top_p") and "\n" not in refused
