"""train.optimizer_in_backward: each weight stepped as its gradient completes, and that
gradient freed at once.

Where a step's gradient comes from one backward and nothing clips (the only configs the check
lets through), the step in the backward is the same update as the optimizer's step after the
backward: the same weights, bit for bit, from a plain model loop and from whole runs (GRPO,
PPO's critic beside the policy, LoRA, checkpointed layers, minibatches); the whole set of
gradients is never held at once; a stopped run resumes as if never stopped.
"""

import copy

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
import grpo.train.layouts as layouts
import grpo.train.step as step
from grpo.errors import UserError
from grpo.train.optimizers import StepInBackward, build_optimizer
from tests.train.test_learning import gain
from tests.train.test_optimizers import DETERMINISTIC, batches, settings

STEP_IN_BACKWARD = {"optimizer_in_backward": True, "max_grad_norm": 0}


@pytest.fixture(scope="module")
def start(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model)


def trained(start, name, inputs, in_backward):
    """`inputs` as five updates of a copy of `start` (one backward each); the weights, and the
    gradient norm each update's step returned."""
    model = copy.deepcopy(start)
    params = list(model.parameters())
    optimizer = build_optimizer(settings(name, optimizer_in_backward=in_backward), [{"params": params, "lr": 1e-2}])
    norms = []
    for ids in inputs:
        model(input_ids=ids, labels=ids).loss.backward()
        if in_backward:
            assert all(p.grad is None for p in params)  # stepped and freed in the backward
        norms.append(optimizer.step())
        optimizer.zero_grad()
    return model, optimizer, norms


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit"])
def test_the_step_in_the_backward_is_the_optimizer_s_step_bit_for_bit(start, name):
    inputs = batches(5, seed=2)
    exact, _, exact_norms = trained(start, name, inputs, in_backward=False)
    ours, optimizer, norms = trained(start, name, inputs, in_backward=True)
    assert isinstance(optimizer, StepInBackward)
    for (key, a), b in zip(exact.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a, b), key
    assert norms == pytest.approx(exact_norms, rel=1e-5)


def test_the_whole_gradient_is_never_held(start):
    """The bytes of gradient held at once, sampled as each tensor's gradient completes: at
    most a tenth of the whole set (the tied embedding's, the largest tensor, is a third of
    this model); AdamW after the backward holds all of it."""
    model = copy.deepcopy(start)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    held = []
    for p in params:  # registered before the optimizer's hooks: runs first, as the gradient completes
        p.register_post_accumulate_grad_hook(
            lambda _: held.append(sum(q.grad.numel() for q in params if q.grad is not None))
        )
    optimizer = build_optimizer(settings("adamw", optimizer_in_backward=True), [{"params": params, "lr": 1e-2}])
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(held) == len(params) and max(held) <= 0.4 * total and sum(held) / len(held) < 0.1 * total, (
        max(held) / total
    )
    optimizer.remove_hooks()


def runs(make_config, tmp_path, algorithm="grpo", **sections):
    """The same run with the step after the backward and inside it (nothing clips), both with
    every row's prompt in its own pass, as the step in the backward runs the update."""
    out = []
    for name, extra in (("after", {"max_grad_norm": 0}), ("inside", STEP_IN_BACKWARD)):
        config = make_config(algorithm, output_dir=str(tmp_path / name), **sections)
        config["train"] = {**config["train"], "steps": 3, "lr": 1e-2, "sample_every": 0, **extra}
        unshared = property(lambda e: layouts.layout_named(e.decisions.layout).unshared())
        with mock.patch.object(step.Engine, "update_layout", unshared):
            out.append(grpo.train(config, progress=False))
    return out


def test_the_update_does_not_share_prompts_with_the_step_in_the_backward(make_config, tmp_path, monkeypatch):
    """A weight that the prompt's shared pass and the completions' pass both use has its
    gradient complete only at the end of the backward: in the shared-prompt layout the update
    runs every row in full. The packed layout runs a group's prompt once inside its one pass,
    and shares it under the step in the backward too."""
    shared = []
    plain = step._policy_logprobs

    def recorded(e, *args, **kwargs):
        shared.append(e.update_layout.shares_prompts)
        return plain(e, *args, **kwargs)

    monkeypatch.setattr(step, "_policy_logprobs", recorded)
    for layout in ("shared", "packed"):
        for name, extra in (("after", {}), ("inside", STEP_IN_BACKWARD)):
            shared.clear()
            config = make_config(output_dir=str(tmp_path / layout / name))
            config["train"] = {**config["train"], "steps": 1, "sample_every": 0, "layout": layout, **extra}
            grpo.train(config, progress=False)
            assert shared and set(shared) == {name == "after" or layout == "packed"}, (layout, name)


def same_runs(after, inside):
    assert [{k: m[k] for k in DETERMINISTIC} for m in inside.metrics] == [
        {k: m[k] for k in DETERMINISTIC} for m in after.metrics
    ]
    ours = AutoModelForCausalLM.from_pretrained(inside.final_dir).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(after.final_dir).state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(
    "algorithm, sections",
    [
        ("grpo", {}),  # a group's prompt run once for its completions (the shared-prompt layout)
        (
            "grpo",
            {"train": {"gradient_checkpointing": True, "minibatches": 2, "optimizer": "adamw_8bit", "warmup_steps": 3}},
        ),
        ("ppo", {}),  # the critic's weights stepped in the same backward
    ],
    ids=["grpo", "checkpointed-minibatches-8bit", "ppo"],
)
def test_a_run_steps_in_the_backward_as_it_would_after_it(make_config, tmp_path, algorithm, sections):
    base = make_config(algorithm)
    merged = {k: {**base.get(k, {}), **v} for k, v in sections.items()}
    train = merged.pop("train", {})
    after, inside = runs(make_config, tmp_path, algorithm, **merged, train={**base["train"], **train})
    same_runs(after, inside)
    assert all(m["grad_norm"] > 0 for m in inside.metrics)


def test_lora_steps_its_adapters_in_the_backward(make_config, tmp_path):
    after, inside = runs(make_config, tmp_path, lora={"r": 4})
    assert [m["loss"] for m in inside.metrics] == [m["loss"] for m in after.metrics]
    assert [m["grad_norm"] for m in inside.metrics] == pytest.approx([m["grad_norm"] for m in after.metrics], rel=1e-5)


def test_a_stopped_run_resumes_as_if_never_stopped(make_config, tmp_path):
    train = {"steps": 4, "lr": 1e-3, "sample_every": 0, **STEP_IN_BACKWARD}
    straight = grpo.train(make_config(output_dir=str(tmp_path / "straight"), train=train), progress=False)
    stopped = make_config(output_dir=str(tmp_path / "stopped"), train=train)
    grpo.train(stopped, overrides=["train.steps=2"], progress=False)
    resumed = grpo.train(stopped, resume=True, progress=False)
    same_runs(straight, resumed)


def test_the_step_cannot_move_in_or_out_of_the_backward_on_resume(make_config):
    config = make_config(train={"steps": 1, "max_grad_norm": 0})
    grpo.train(config, progress=False)
    with pytest.raises(UserError, match=r"train.optimizer_in_backward: False -> True"):
        grpo.train(config, overrides=["train.steps=2", "train.optimizer_in_backward=true"], resume=True, progress=False)


@pytest.mark.learning
def test_grpo_learns_the_sevens_reward_with_every_saver(make_config):
    """The step in the backward with 8-bit AdamW and a bf16 reference, unclipped, as
    tests/train/test_learning.py's exact run: 40 steps at lr 1e-3 gain at least 0.25."""
    train = {"steps": 40, "lr": 1e-3, "sample_every": 0, "optimizer": "adamw_8bit", "reference_dtype": "bfloat16"}
    result = grpo.train(make_config(train={**train, **STEP_IN_BACKWARD}), progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
