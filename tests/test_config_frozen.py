"""A validated config is read-only: what a run decides from it is returned by what decides
it (grpo.train.step.Decisions), never written back. Before validation it is plain data."""

import copy
import dataclasses

import pytest

from grpo.config import Config, config_from_dict

MINIMAL = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "exact_answer"}]}


def test_a_validated_config_refuses_every_change():
    c = config_from_dict(MINIMAL)
    for section, name, value in [
        (c, "seed", 1),
        (c.train, "gradient_checkpointing", False),
        (c.rollout.async_, "timeout", 1.0),  # a section inside a section
        (c.rewards[0], "weight", 2.0),  # a section in a list
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError, match=rf"cannot set \w+\.{name}: a validated config"):
            setattr(section, name, value)
    assert copy.deepcopy(c) == c and c.seed == 0 and c.rewards[0].weight == 1.0


def test_before_validation_a_config_is_plain_data():
    tree = copy.deepcopy(MINIMAL)
    tree["train"] = {"steps": 3}  # the mapping a test or a caller changes before validating
    c = Config()
    c.train.steps = 5  # a section built directly has not been validated
    assert c.train.steps == 5 and config_from_dict(tree).train.steps == 3
    changed = dataclasses.replace(config_from_dict(tree).train, steps=4)  # another one, built
    changed.steps = 6
    assert changed.steps == 6
