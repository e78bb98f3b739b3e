"""train.optimizer: the factory, and the 8-bit AdamW (bitsandbytes) against torch's AdamW.

adamw_8bit approximates AdamW: its moments are rounded to 8 bits at every step, so its
weights drift from AdamW's by a few percent of the update, never more; it must save and
restore its state exactly (a resumed run equals a straight one, bit for bit), learn as
AdamW does, and say in one line what to install when bitsandbytes is missing.
"""

import copy
import importlib.util
import io
import typing
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
from grpo.config import TrainConfig
from grpo.errors import UserError
from grpo.train.optimizers import OPTIMIZERS, build_optimizer
from tests.conftest import ALPHABET
from tests.train.test_learning import gain

SETTINGS = dict(lr=1e-2, adam_betas=[0.8, 0.95], weight_decay=0.1)  # not the defaults: each must reach the optimizer
# Steps as the optimizer alone takes them: no clipping, a constant learning rate.
PLAIN = dict(optimizer_in_backward=False, max_grad_norm=0.0, schedule="constant", warmup_steps=0)


def settings(name, **changes):
    return SimpleNamespace(optimizer=name, **{**SETTINGS, **PLAIN, **changes})


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 4 + len(ALPHABET), (8, 12), generator=g) for _ in range(n)]


def updates(model, optimizer, inputs):
    for ids in inputs:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def trained(start, name, inputs, **changes):
    model = copy.deepcopy(start)
    optimizer = build_optimizer(settings(name, **changes), [{"params": list(model.parameters()), "lr": SETTINGS["lr"]}])
    updates(model, optimizer, inputs)
    return model, optimizer


@pytest.fixture(scope="module")
def start(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model)


def test_the_config_names_every_optimizer():
    assert typing.get_args(typing.get_type_hints(TrainConfig)["optimizer"]) == tuple(OPTIMIZERS)
    assert TrainConfig().optimizer == "adamw"


def test_adamw_is_torchs_fused_adamw_with_the_config_s_settings(start):
    model = copy.deepcopy(start)
    optimizer = build_optimizer(settings("adamw"), [{"params": list(model.parameters()), "lr": 1e-2}])
    assert type(optimizer.torch) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["fused"] and group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1 and group["lr"] == 1e-2


def test_the_optimizer_clips_each_group_by_its_own_norm_and_schedules_the_lr():
    """`step()` clips each param group (the policy's, the critic's) by its own norm, steps,
    moves the schedule, and returns the first group's norm before clipping."""
    policy, critic = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    train = settings("adamw", max_grad_norm=1.0, schedule="linear")
    optimizer = build_optimizer(train, [{"params": [policy], "lr": 1e-2}, {"params": [critic], "lr": 1e-3}], updates=4)
    policy.grad, critic.grad = torch.full((3,), 4.0), torch.full((4,), 0.1)  # norms sqrt(48) and 0.2
    seen = []
    optimizer.torch.register_step_pre_hook(lambda *_: seen.append((policy.grad.clone(), critic.grad.clone())))
    assert optimizer.step() == pytest.approx(48**0.5, rel=1e-6)
    (clipped, untouched), eps = seen[0], torch.finfo(torch.float32).eps
    assert float(clipped.norm()) == pytest.approx(1.0, rel=10 * eps)  # clipped to max_grad_norm
    assert torch.equal(untouched, torch.full((4,), 0.1))  # under its own limit: as it was
    assert optimizer.version == 1 and optimizer.lr == pytest.approx(1e-2 * 0.75, rel=eps)  # linear decay, 1 of 4
    optimizer.zero_grad()
    assert policy.grad is None and critic.grad is None


def test_8bit_adamw_approximates_adamw_over_five_updates(start):
    """Five updates at lr 1e-2 from the same weights on the same batches: each tensor's total
    update is within 5% (relative L2) of AdamW's, pointing the same way (cosine > 0.998);
    measured: at most 1.7%, cosine >= 0.9998. The large tensors' moments are 8-bit (uint8,
    a quarter of AdamW's bytes with their block scales); tensors under 4096 values keep fp32
    moments (bitsandbytes' min_8bit_size)."""
    inputs = batches(5)
    exact, _ = trained(start, "adamw", inputs)
    approx, optimizer = trained(start, "adamw_8bit", inputs)
    before = dict(start.named_parameters())
    with torch.no_grad():
        for (name, got), want in zip(approx.named_parameters(), exact.parameters(), strict=True):
            ours, theirs = (got - before[name]).flatten(), (want - before[name]).flatten()
            assert float((ours - theirs).norm() / theirs.norm()) < 0.05, name
            assert float(torch.nn.functional.cosine_similarity(ours, theirs, dim=0)) > 0.998, name
    # Which moments are 8-bit, and what they hold.
    eight_bit = quarter = 0
    for p in approx.parameters():
        state = optimizer.torch.state[p]
        if p.numel() >= 4096:
            assert state["state1"].dtype == state["state2"].dtype == torch.uint8
            held = sum(state[k].numel() * state[k].element_size() for k in ("state1", "state2", "absmax1", "absmax2"))
            eight_bit += 1
            quarter += held <= 0.3 * 8 * p.numel()  # AdamW: two fp32 moments, 8 bytes a value
        else:
            assert state["state1"].dtype == torch.float32
    assert eight_bit == quarter > 0


def test_8bit_state_survives_a_checkpoint_exactly(start):
    """Three updates, the weights and state through torch.save and a weights_only load (as a
    checkpoint's), two more in a fresh optimizer: the same weights, bit for bit, as five in one."""
    inputs = batches(5, seed=1)
    straight, _ = trained(start, "adamw_8bit", inputs)
    first, optimizer = trained(start, "adamw_8bit", inputs[:3])
    saved = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    resumed = copy.deepcopy(start)
    resumed.load_state_dict(state["model"])
    fresh = build_optimizer(settings("adamw_8bit"), [{"params": list(resumed.parameters()), "lr": SETTINGS["lr"]}])
    fresh.load_state_dict(state["optimizer"])
    updates(resumed, fresh, inputs[3:])
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_large_tensor_s_8bit_step_in_pieces_equals_bitsandbytes_whole_step(monkeypatch):
    """Pieces of 1,024 values (4 blocks) over 10,000 values (the last piece and block partial):
    weights, both 8-bit moments and their scales equal bitsandbytes' own step on the whole
    tensor, bit for bit, over three steps."""
    import bitsandbytes as bnb

    import grpo.train.optimizers as optimizers

    monkeypatch.setattr(optimizers, "CHUNK", 1024)
    g = torch.Generator().manual_seed(0)
    start = torch.randn(100, 100, generator=g)
    grads = [torch.randn(100, 100, generator=g) for _ in range(3)]
    settings = dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    whole, pieces = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    reference = bnb.optim.AdamW8bit([whole], **settings)
    ours = optimizers.adamw_8bit([{"params": [pieces]}], **settings)
    assert type(ours) is not bnb.optim.AdamW8bit  # the pieces' step, not bitsandbytes' own
    for grad in grads:
        for p, optimizer in ((whole, reference), (pieces, ours)):
            p.grad = grad.clone()
            optimizer.step()
        assert torch.equal(whole, pieces)
    a, b = reference.state[whole], ours.state[pieces]
    assert a["state1"].dtype == torch.uint8
    for key in ("state1", "state2", "absmax1", "absmax2", "step"):
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


DETERMINISTIC = ("step", "reward/mean", "reward/std", "loss", "kl", "entropy", "grad_norm", "lr")


def test_a_stopped_8bit_run_resumes_as_if_never_stopped(make_config, tmp_path):
    """A run of 2 steps, resumed to 4 (train.steps may grow on resume), against 4 straight:
    the same metrics and final weights, bit for bit."""
    settings = dict(train={"steps": 4, "lr": 1e-3, "optimizer": "adamw_8bit", "sample_every": 0})
    straight = grpo.train(make_config(output_dir=str(tmp_path / "straight"), **settings), progress=False)
    stopped = make_config(output_dir=str(tmp_path / "stopped"), **settings)
    grpo.train(stopped, overrides=["train.steps=2"], progress=False)
    resumed = grpo.train(stopped, resume=True, progress=False)
    assert [{k: m[k] for k in DETERMINISTIC} for m in resumed.metrics] == [
        {k: m[k] for k in DETERMINISTIC} for m in straight.metrics
    ]
    ours = AutoModelForCausalLM.from_pretrained(resumed.final_dir).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(straight.final_dir).state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_the_optimizer_cannot_change_on_resume(make_config):
    config = make_config(train={"steps": 1})
    grpo.train(config, progress=False)
    with pytest.raises(UserError, match=r"train.optimizer: 'adamw' -> 'adamw_8bit'"):
        grpo.train(config, overrides=["train.steps=2", "train.optimizer=adamw_8bit"], resume=True, progress=False)


@pytest.mark.learning
def test_grpo_learns_the_sevens_reward_with_8bit_adamw(make_config):
    """As tests/train/test_learning.py's AdamW run: 40 steps at lr 1e-3 gain at least 0.25."""
    config = make_config(train={"steps": 40, "lr": 1e-3, "sample_every": 0, "optimizer": "adamw_8bit"})
    result = grpo.train(config, progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]


def test_a_missing_bitsandbytes_is_one_line_before_anything_is_loaded(make_config, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "bitsandbytes" else real(name, *a, **k)
    )
    monkeypatch.setattr("grpo.train.models.load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    config = make_config(output_dir=str(tmp_path / "never"), train={"optimizer": "adamw_8bit"})
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    assert str(err.value) == (
        "train.optimizer: adamw_8bit needs bitsandbytes, which is not installed: pip install 'grpo[memory]' (bitsandbytes)"
    )
    assert not (tmp_path / "never").exists()


def test_a_checkpoint_from_before_train_optimizer_resumes_as_adamw():
    """A checkpoint whose config predates the key held AdamW's state: it resumes with adamw
    and is refused with adamw_8bit."""
    from grpo.config import config_from_dict, config_to_dict
    from grpo.train.output_dir import check_resume_config

    config = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "exact_answer"}]}
    saved = config_to_dict(config_from_dict(config))
    del saved["train"]["optimizer"]
    check_resume_config(config_from_dict(config), {"config": saved})
    with pytest.raises(UserError, match=r"train.optimizer: 'adamw' -> 'adamw_8bit'"):
        check_resume_config(config_from_dict(config, ["train.optimizer=adamw_8bit"]), {"config": saved})
