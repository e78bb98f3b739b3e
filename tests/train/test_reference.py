"""The reference and its memory: none at all with beta = 0, the frozen copy in bf16
(train.reference_dtype), and LoRA's reference as the base with its adapter off (no copy).

With beta = 0 a run holds no reference and runs no reference pass, and its numbers are those
of a run that held one and multiplied its KL term by 0; its `kl` metric is null. A bf16
copy holds half the bytes of an fp32 one, and its log-probs are the fp32 copy's within bf16
rounding (the tolerances below, measured on peaked tiny models, are stated per test). Under
torchrun the bf16 copy is reset from the sharded policy: tests/train/test_distributed.py.
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
import grpo.train.assembly as assembly
from grpo.train.layouts import PACKED, decide_layouts, layout_named
from grpo.train.networks import AdapterOff, FrozenCopy, NoReference
from grpo.train.seams import KLInLoss
from tests.algo.test_chunked_head import batch_of, tiny_lm
from tests.rollout.test_fast import model_of
from tests.train.test_engine import engine_for
from tests.train.test_learning import gain
from tests.train.test_models import rollout

MEASURED = ("time/", "memory/")  # measurements, not results


def results(metrics, leave_out=()):
    return [{k: v for k, v in m.items() if not k.startswith(MEASURED) and k not in leave_out} for m in metrics]


def final_weights(result):
    return AutoModelForCausalLM.from_pretrained(result.final_dir).state_dict()


# ---- beta = 0: no reference ------------------------------------------------------------------


def test_with_beta_zero_the_engine_holds_no_reference(make_config, tiny_model):
    e, c, _ = engine_for(make_config(loss={"beta": 0.0}, train={"reference_dtype": "bfloat16"}))
    assert isinstance(e.reference, NoReference) and e.reference.networks == []
    assert not any(isinstance(v, FrozenCopy) for v in vars(e).values())
    policy = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters())
    assert assembly.parameters_held(e, {}) == policy  # the policy's weights, held once


def test_a_beta_zero_run_equals_one_that_holds_a_reference_and_weighs_its_kl_by_zero(
    make_config, tmp_path, monkeypatch
):
    """The reference's only part in the loss is beta * KL: without it (no copy, no pass) the
    rewards, losses, gradient norms and final weights are those of a run that held a copy,
    ran its pass and multiplied the KL term by 0, bit for bit."""
    settings = dict(loss={"beta": 0.0}, train={"steps": 3, "lr": 1e-2, "sample_every": 0})
    without = grpo.train(make_config(output_dir=str(tmp_path / "without"), **settings), progress=False)

    def held_reference(policy, *, beta, lora, dtype, full_state_dict=None, chunked_head=True, stored=None, layout=None):
        return FrozenCopy(policy, dtype, full_state_dict, chunked_head, stored=stored, layout=layout)

    monkeypatch.setattr(assembly, "build_reference", held_reference)
    monkeypatch.setattr(assembly, "build_kl", lambda c: KLInLoss(0.0, "k3"))
    held = grpo.train(make_config(output_dir=str(tmp_path / "held"), **settings), progress=False)

    assert all(m["kl"] is None for m in without.metrics)  # no reference: no KL to report
    assert all(m["kl"] is not None for m in held.metrics) and held.metrics[-1]["kl"] > 0  # its pass ran
    assert results(without.metrics, {"kl", "models"}) == results(held.metrics, {"kl", "models"})
    ours, theirs = final_weights(without), final_weights(held)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---- the frozen copy in bf16 -----------------------------------------------------------------


def bytes_of(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize(
    "make,mean,most",
    [
        # Peaked tiny models (weights drawn at 0.3): measured mean 0.039 / 0.030 / 0.012, max 0.14 / 0.10 / 0.04 nats.
        (lambda: model_of(eos_bias=1.5), 0.06, 0.25),
        (lambda: tiny_lm("qwen2", tied=True), 0.06, 0.25),
        (lambda: tiny_lm("gemma2"), 0.06, 0.25),
    ],
    ids=["llama", "qwen2-tied", "gemma2"],
)
def test_a_bf16_copy_holds_half_the_bytes_and_gives_the_fp32_log_probs_within_bf16_rounding(make, mean, most):
    model = make()
    batch = rollout(model, ["a", "bc1", "cab 7"]) if model.config.model_type == "llama" else batch_of(40)
    exact, half = FrozenCopy(model), FrozenCopy(model, stored=torch.bfloat16)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert [b.dtype for b in half.model.buffers()] == [b.dtype for b in model.buffers()]  # rotary frequencies kept
    assert bytes_of(half.model) * 2 == bytes_of(model)  # tied weights stay one tensor
    mask = batch.completion_mask.bool()
    error = (half.logprobs(batch, 1.0) - exact.logprobs(batch, 1.0))[mask].abs()
    assert 0 < float(error.mean()) < mean and float(error.max()) < most


def rounded(model):
    """A float32 copy of `model` with every weight rounded to bf16."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p in copied.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return copied


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "make", [lambda: model_of(eos_bias=1.5), lambda: tiny_lm("qwen2", tied=True)], ids=["llama", "qwen2-tied"]
)
def test_without_bf16_instructions_a_bf16_copy_computes_in_float32_from_its_rounded_weights(
    make, attention, chunked, monkeypatch
):
    """On a CPU without AVX-512 BF16 or AMX: the log-probs of the bf16-rounded weights computed
    in float32, bit for bit, with the weights still stored in bf16 after the pass; in the
    packed layout (its mask made in float32, which SDPA needs) as in any other."""
    model = make()
    model.set_attn_implementation(attention)
    layout = decide_layouts(model, checkpointing=False).plain
    assert layout == PACKED
    batch = rollout(model, ["a", "bc1", "cab 7"]) if model.config.model_type == "llama" else batch_of(40)
    monkeypatch.setattr("grpo.train.networks.native", lambda dtype, device: False)
    half = FrozenCopy(model, chunked_head=chunked, stored=torch.bfloat16, layout=layout_named(layout))
    got = half.logprobs(batch, 0.9)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert bytes_of(half.model) * 2 == bytes_of(model)
    want = FrozenCopy(rounded(model), chunked_head=chunked, layout=layout_named(layout)).logprobs(batch, 0.9)
    assert torch.equal(got, want)
    monkeypatch.setattr("grpo.train.networks.native", lambda dtype, device: True)
    in_bf16 = FrozenCopy(model, chunked_head=chunked, stored=torch.bfloat16, layout=layout_named(layout))
    in_bf16 = in_bf16.logprobs(batch, 0.9)
    assert not torch.equal(in_bf16, want)  # where it is native, the forward runs in bf16


def test_a_bf16_copy_is_its_own_and_catches_up_with_the_policy_rounded():
    """The copy shares no storage with the policy (a bf16 policy's weights are copied too);
    reset_to loads the moved policy's weights, rounded to bf16."""
    policy = model_of().to(torch.bfloat16)
    reference = FrozenCopy(policy, stored=torch.bfloat16)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    assert all(torch.equal(before[k], v) for k, v in reference.state_dict().items())
    moved = model_of()
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1.1)
    reference.reset_to(moved)
    got = reference.state_dict()
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in moved.state_dict().items())


def test_a_run_with_a_bf16_reference_keeps_it_in_bf16_and_measures_its_rounding(make_config, tmp_path):
    """The engine's copy is bf16 and the policy fp32; the first step's KL, 0 with an fp32
    copy of the same weights, is bf16's rounding: above 0, below 1e-4."""
    e, _, _ = engine_for(make_config(train={"reference_dtype": "bfloat16"}))
    assert {p.dtype for p in e.reference.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in e.policy.parameters()} == {torch.float32}
    exact = grpo.train(make_config(output_dir=str(tmp_path / "fp32"), train={"steps": 1}), progress=False)
    half = grpo.train(
        make_config(output_dir=str(tmp_path / "bf16"), train={"steps": 1, "reference_dtype": "bfloat16"}),
        progress=False,
    )
    assert exact.metrics[0]["kl"] == 0.0 and 0 < half.metrics[0]["kl"] < 1e-4
    assert exact.metrics[0]["reward/mean"] == half.metrics[0]["reward/mean"]  # sampled before any update


def test_the_lora_reference_is_the_base_and_holds_no_copy_in_any_dtype(make_config):
    e, _, _ = engine_for(make_config(lora={"r": 4}, train={"reference_dtype": "bfloat16"}))
    assert isinstance(e.reference, AdapterOff) and e.reference.networks == [] and e.reference.policy is e.policy


@pytest.mark.learning
def test_grpo_learns_the_sevens_reward_with_the_savers_together(make_config):
    """8-bit AdamW and a bf16 reference, as tests/train/test_learning.py's exact run: 40 steps
    at lr 1e-3 gain at least 0.25."""
    train = {"steps": 40, "lr": 1e-3, "sample_every": 0, "optimizer": "adamw_8bit", "reference_dtype": "bfloat16"}
    result = grpo.train(make_config(train=train), progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
