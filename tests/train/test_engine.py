"""The engine's pieces: what is loaded, what is computed, and what is skipped."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo
import grpo.train.step as step_module
from grpo.infra import attention as segments
from grpo.config import config_from_dict
from grpo.data import PromptStream, load_rows
from grpo.rewards import load_rewards
from grpo.rollout.sampler import Sampler, completion_mask
from grpo.train.loop import build_engine
from grpo.train.layouts import policy_logprobs
from grpo.train.step import learn
from tests.helpers import UPDATE, assert_close_scaled, run_generator, sample, sampled_step, update_gap


def engine_for(config_dict):
    c = config_from_dict(config_dict)
    torch.manual_seed(c.seed)
    e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
    e.generator = run_generator(c, e)  # the run's, for the steps below
    stream = PromptStream(load_rows(c.data.path, prompt_column=c.data.prompt_column), seed=c.seed)
    return e, c, stream


def train_step(e, rows, seeds=None, step=0):
    """A step of the loop on `rows`: sampled by the engine's generator, then trained."""
    return sampled_step(e, e.generator, rows, seeds, step)


def collect(e, rows, step=0):
    return step_module.collect(e, sample(e, e.generator, rows, step=step), step)


def test_completion_mask_stops_after_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    got = completion_mask(ids, eos_token_id=2)
    assert got.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_sampler_keeps_each_prompts_group_contiguous(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=3, max_new_tokens=5)
    torch.manual_seed(0)
    rows = [{"prompt": "ab"}, {"prompt": "cab"}]
    batch = sampler.sample(model, rows)
    assert len(batch) == 6 and batch.completion_mask.shape == (6, batch.completion_ids.shape[1])
    assert [r["prompt"] for r in batch.rows] == ["ab"] * 3 + ["cab"] * 3
    # Left-padded prompts: every row's prompt ends right before its completion.
    decoded = tokenizer.batch_decode(batch.input_ids[:, : -batch.completion_mask.shape[1]], skip_special_tokens=True)
    assert decoded == ["ab"] * 3 + ["cab"] * 3
    assert batch.completions == tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)


def test_generation_in_chunks_keeps_groups_and_masks_right(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=3, max_new_tokens=6, batch_size=4)
    torch.manual_seed(0)
    batch = sampler.sample(model, [{"prompt": "ab"}, {"prompt": "cab"}])
    assert len(batch) == 6 and [r["prompt"] for r in batch.rows] == ["ab"] * 3 + ["cab"] * 3
    assert batch.completion_mask.tolist() == completion_mask(batch.completion_ids, tokenizer.eos_token_id).tolist()
    assert batch.completions == tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)


def test_one_update_epoch_needs_no_old_policy_pass(make_config, monkeypatch):
    calls = []
    monkeypatch.setattr(step_module, "policy_logprobs", lambda *a, **k: calls.append(1) or policy_logprobs(*a, **k))
    e, c, stream = engine_for(make_config())
    train_step(e, stream.take(c.rollout.prompts_per_step))
    assert calls == []
    e, c, stream = engine_for(make_config(train={"epochs": 2, "lr": 1e-3}))
    result = train_step(e, stream.take(c.rollout.prompts_per_step))
    assert calls == [1]  # one pass for the old policy, before the first update
    assert result.metrics["clip_fraction"] >= 0.0


def test_a_batch_sampled_by_earlier_weights_gets_the_old_policy_pass(make_config, monkeypatch):
    """Collected while the policy moved on (as an asynchronous rollout is), a batch's old
    policy is no longer the current one: with train.old_logprobs: recompute, even with one
    epoch and one minibatch the update takes the old-policy pass rather than its own
    log-probs, detached (auto takes the sampler's: the next test)."""
    calls = []
    monkeypatch.setattr(step_module, "policy_logprobs", lambda *a, **k: calls.append(1) or policy_logprobs(*a, **k))
    e, c, stream = engine_for(make_config(train={"lr": 1e-3, "old_logprobs": "recompute"}))
    first, second = (collect(e, stream.take(c.rollout.prompts_per_step), step=i) for i in range(2))
    assert e.version == 0 and first.batch.policy_version == second.batch.policy_version == 0
    assert not e.needs_old_logprobs(first.batch)
    learn(e, first)
    assert calls == [] and e.version == 1  # one optimizer step
    assert e.needs_old_logprobs(second.batch)
    learn(e, second)
    assert calls == [1] and e.version == 2
    # A batch the current weights sampled needs none again; the version is stamped as sampled.
    third = collect(e, stream.take(c.rollout.prompts_per_step), step=2)
    assert third.sampled.policy_version == third.batch.policy_version == 2 and not e.needs_old_logprobs(third.batch)


def test_the_policy_version_is_restored_with_the_scheduler(make_config):
    e, c, stream = engine_for(make_config(train={"epochs": 2, "minibatches": 2}))
    train_step(e, stream.take(c.rollout.prompts_per_step))
    assert e.version == 4  # 2 epochs x 2 minibatches
    resumed, _, _ = engine_for(make_config(train={"epochs": 2, "minibatches": 2}))
    resumed.optimizer.scheduler.load_state_dict(e.optimizer.scheduler.state_dict())  # as a checkpoint's resume does
    assert resumed.version == 4


def test_micro_batches_give_the_same_update_as_the_whole_batch(make_config):
    weights, norms = [], []
    for micro in (0, 5):  # 5: micro-batches that cut groups apart (their prompt pass is shared differently)
        e, c, stream = engine_for(make_config(train={"micro_batch_size": micro, "lr": 1e-3}))
        before = {k: v.clone() for k, v in e.policy.state_dict().items()}
        result = train_step(e, stream.take(c.rollout.prompts_per_step))
        weights.append({k: v.clone() for k, v in e.policy.state_dict().items()})
        norms.append(result.metrics["grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)  # the gradient's scale (Adam's step would hide it)
    # Summation order differs, and Adam turns rounding in near-zero gradients into lr-sized steps.
    assert update_gap(before, weights[1], weights[0]) < UPDATE


def test_beta_zero_loads_no_reference(make_config):
    result = grpo.train(make_config(loss={"beta": 0.0}, train={"steps": 2}), progress=False)
    assert result.models_held == 2  # policy and reward only
    assert all(m["kl"] is None for m in result.metrics)


def test_groups_with_equal_rewards_can_be_dropped(make_config, tiny_model):
    config = make_config(
        rewards=[{"function": "tests.train.rewards_for_tests:constant"}],
        loss={"drop_zero_std_groups": True},
        train={"steps": 2},
    )
    result = grpo.train(config, progress=False)
    assert all(m["frac_zero_std_groups"] == 1.0 for m in result.metrics)
    assert all(m["tokens/trained"] == 0 and m["tokens/completion"] > 0 for m in result.metrics)
    assert all(m["loss"] is None and m["reward/mean"] == 0.5 for m in result.metrics)
    before = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    after = AutoModelForCausalLM.from_pretrained(result.final_dir).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_unscored_completions_are_counted_and_left_out(make_config):
    config = make_config(rewards=[{"function": "tests.train.rewards_for_tests:sevens_or_none"}], train={"steps": 3})
    metrics = grpo.train(config, progress=False).metrics
    assert any(0 < m["frac_unscored"] < 1 for m in metrics)
    assert all(m["reward/mean"] is not None for m in metrics)


def test_chat_prompts_go_through_the_chat_template(make_config, tiny_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    model_dir = tmp_path / "chat-model"
    AutoModelForCausalLM.from_pretrained(tiny_model).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in ["ab", "ba"]))
    config = make_config(
        model=str(model_dir),
        data={"path": str(data), "prompt_column": "messages"},
        rollout={"prompts_per_step": 2},
        train={"steps": 1},
    )
    e, c, stream = engine_for(config)
    batch = e.generator.samplers["train"].sample(e.policy, stream.take(2))
    assert sorted(set(batch.prompts)) == ["ab=", "ba="]
    assert grpo.train(config, progress=False).metrics[0]["step"] == 1


def test_lora_reference_is_the_adapter_switched_off(make_config, tiny_model):
    e, c, stream = engine_for(make_config(lora={"r": 4, "alpha": 8}))
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    batch = e.generator.samplers["train"].sample(e.policy, stream.take(2))
    for _ in range(3):
        train_step(e, stream.take(c.rollout.prompts_per_step))
    # The policy moved; the reference is still the base model, with no second copy held.
    with torch.no_grad():
        torch.testing.assert_close(e.reference.logprobs(batch, 1.0), policy_logprobs(base, batch, 1.0))
        assert not torch.allclose(policy_logprobs(e.policy, batch, 1.0), policy_logprobs(base, batch, 1.0))
    trainable = sum(p.numel() for p in e.policy.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in base.parameters()) / 2


def test_lora_run_saves_a_plain_model(make_config):
    result = grpo.train(make_config(lora={"r": 4}, train={"steps": 2}), progress=False)
    assert result.models_held == 3
    final = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert not any("lora" in k for k in final.state_dict())


def test_tensorboard_sink_writes_events(make_config, tmp_path):
    result = grpo.train(make_config(train={"steps": 2, "tensorboard": True}), progress=False)
    assert list((result.output_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    "attention,max_new_tokens,expected",
    [("auto", 8, "eager"), ("auto", 600, "sdpa"), ("sdpa", 8, "sdpa"), ("eager", 600, "eager")],
)
def test_train_attention_picks_the_kernel_of_policy_and_reference(make_config, attention, max_new_tokens, expected):
    e, _, _ = engine_for(
        make_config(train={"attention": attention}, rollout={"max_new_tokens": max_new_tokens, "min_new_tokens": 0})
    )
    assert segments.kernel(e.policy) == expected
    assert segments.kernel(e.reference.model) == expected
    assert getattr(e.policy, segments._ENABLED)  # the packed layout's passes by segments, around that kernel


def test_autocast_reaches_the_sampler_the_reference_and_the_update(make_config):
    e, _, _ = engine_for(make_config(train={"autocast": "bfloat16"}))
    assert e.compute_dtype is torch.bfloat16 and e.generator.samplers["train"].autocast is torch.bfloat16
    assert e.reference.model.lm_head.weight.dtype == torch.bfloat16
    assert e.policy.lm_head.weight.dtype == torch.float32  # the policy's weights stay in train.dtype
    e, _, _ = engine_for(make_config())
    assert e.compute_dtype is None and e.reference.model.lm_head.weight.dtype == torch.float32


def test_gradient_checkpointing_recomputes_layers_and_changes_no_number(make_config, tmp_path):
    metrics, calls = {}, {}
    for on in (False, True):
        e, c, stream = engine_for(
            make_config(output_dir=str(tmp_path / str(on)), train={"gradient_checkpointing": on, "lr": 1e-3})
        )
        count = {"layer": 0, "attention": 0}
        layer = e.policy.model.layers[0]
        layer.register_forward_pre_hook(lambda *_: count.__setitem__("layer", count["layer"] + 1))
        layer.self_attn.register_forward_pre_hook(lambda *_: count.__setitem__("attention", count["attention"] + 1))
        results = [train_step(e, stream.take(c.rollout.prompts_per_step)) for _ in range(2)]
        metrics[on], calls[on] = [r.metrics for r in results], count
        assert not e.policy.training  # back in eval mode after the update
    # Per step (the reference is its own copy, not counted): the policy's one packed pass, both
    # ways. With checkpointing the layer's insides run again in the backward (the recomputation
    # calls the layer's forward directly, so only its insides count).
    assert (e.decisions.no_grad_layout, e.decisions.layout) == ("packed", "packed")
    assert calls[False] == {"layer": 2 * 1, "attention": 2 * 1}
    assert calls[True] == {"layer": 2 * 1, "attention": 2 * 2}
    for plain, checkpointed in zip(metrics[False], metrics[True]):
        for key in ("reward/mean", "loss", "kl", "grad_norm"):
            assert checkpointed[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_checkpointing_is_on_by_default_and_a_model_without_support_trains_without(make_config, monkeypatch, capsys):
    e, c, _ = engine_for(make_config())
    assert c.train.gradient_checkpointing and e.policy.is_gradient_checkpointing  # TRL's default
    import grpo.train.models as models

    load = models.load_causal_lm

    def unsupported(*args, **kwargs):
        model = load(*args, **kwargs)
        model.supports_gradient_checkpointing = False
        return model

    monkeypatch.setattr(models, "load_causal_lm", unsupported)
    e, c, stream = engine_for(make_config())
    assert not e.policy.is_gradient_checkpointing and not e.decisions.checkpointing
    assert c.train.gradient_checkpointing  # the config keeps what was asked
    assert "does not support it; training without" in capsys.readouterr().err
    assert e.update_layout.shares_prompts  # the update runs as without checkpointing
    assert train_step(e, stream.take(c.rollout.prompts_per_step)).metrics["grad_norm"] > 0


def test_the_sampler_leaves_the_callers_tokenizer_as_it_was(tiny_model, make_config):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sampler = Sampler(tokenizer, prompt_column="prompt", group_size=2, max_new_tokens=3)
    batch = sampler.sample(model, [{"prompt": "a"}, {"prompt": "cab"}])
    assert batch.attention_mask[0, 0] == 0  # the short prompt was padded on the left
    assert tokenizer.padding_side == "right" and tokenizer.backend_tokenizer.padding is None
    # A trained model's tokenizer pads as the base model's did.
    result = grpo.train(make_config(train={"steps": 1}), progress=False)
    saved = json.loads((result.final_dir / "tokenizer.json").read_text())
    assert saved["padding"] is None and AutoTokenizer.from_pretrained(result.final_dir).padding_side == "right"


@pytest.mark.parametrize(
    "settings,held",
    [
        ({}, True),  # a full fine-tune: the update holds every gradient, the sampling none
        ({"train": {"optimizer_in_backward": True, "max_grad_norm": 0.0}}, False),  # one tensor's at a time
        ({"rollout": {"async": {"max_staleness": 1}}}, False),  # a worker process samples beside the update
    ],
)
def test_the_fast_loops_room_is_the_gradients_the_update_holds(make_config, monkeypatch, settings, held):
    """What the run's samplers may spend on packed weights (`sampling_room`): the bytes of the
    policy's gradients where the update holds them all and the sampling runs between updates
    in this process; else nothing."""
    import grpo.train.assembly as assembly

    specs = []
    monkeypatch.setattr(assembly, "build_generator", lambda spec, *a, **k: specs.append(spec))
    c = config_from_dict(make_config(**settings))
    e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
    assembly.build_run_generator(c, e)
    gradients = sum(p.numel() * 4 for p in e.policy.parameters() if p.requires_grad)
    assert specs[0].spare_bytes == (gradients if held else 0)
    if held:
        assert gradients > 0
        sampler = Sampler.from_config(e.tokenizer, c.rollout, prompt_column="prompt", spare_bytes=specs[0].spare_bytes)
        assert sampler.decoder(e.policy, 4).spare_bytes == gradients


def test_the_fast_loop_fuses_the_weights_once_per_sample(tiny_model, monkeypatch):
    import grpo.rollout.fast as fast

    calls = []
    real = fast.fuse_weights
    monkeypatch.setattr(fast, "fuse_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sampler = Sampler(
        tokenizer, prompt_column="prompt", group_size=3, max_new_tokens=4, batch_size=2, backend="fast", draw="generate"
    )
    sampler.sample(model, [{"prompt": "ab"}, {"prompt": "cab"}])  # 6 completions in 3 decoding calls
    assert calls == [1]
    with torch.no_grad():
        for layer in model.model.layers:  # an update in place, as the optimizer's, of weights the fast loop stacks
            layer.mlp.gate_proj.weight.mul_(50.0)
            layer.mlp.up_proj.weight.mul_(50.0)
    hf = Sampler(tokenizer, prompt_column="prompt", group_size=3, max_new_tokens=4, batch_size=2, backend="hf")
    rows = [{"prompt": "ab"}, {"prompt": "cab"}]
    torch.manual_seed(1)
    fast_batch = sampler.sample(model, rows)  # the next sample decodes with the changed weights
    torch.manual_seed(1)
    assert fast_batch.completions == hf.sample(model, rows).completions
    assert calls == [1, 1]


# ---- train.old_logprobs: the sampler's log-probs as the old policy's ---------------------------


def _counting_policy_passes(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(step_module, "policy_logprobs", lambda *a, **k: calls.append(1) or policy_logprobs(*a, **k))
    return calls


MOVING = {"epochs": 2, "minibatches": 2, "lr": 1e-3}  # the policy moves within a step: old log-probs needed
FREE = {"min_new_tokens": 0}  # the distribution the loss scores (min_new_tokens reshapes it)


def test_auto_takes_the_fast_loops_logprobs_as_the_old_policys_and_they_are_the_passs(make_config, monkeypatch):
    """With the fast loop on float32 weights and nothing reshaping the distribution, auto
    skips the old-policy pass: the sampler's log-probs stand for it. They must be the pass's
    own numbers up to float rounding, or the ratio would be off from the first update."""
    calls = _counting_policy_passes(monkeypatch)
    e, c, stream = engine_for(make_config(rollout=FREE, train=MOVING))
    got = collect(e, stream.take(c.rollout.prompts_per_step))
    batch = got.batch
    assert batch.logprobs_exact and e.old_logprobs_from_sampler(batch) and not e.needs_old_logprobs(batch)
    passes = step_module._passes(e, batch)
    assert calls == [] and passes.old_from_sampler
    recomputed = policy_logprobs(e.policy, batch, c.rollout.temperature, c.rollout.repetition_penalty)
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0
    assert_close_scaled(passes.old_logprobs[mask], recomputed[mask])
    assert bool((passes.old_logprobs[~mask] == 0).all())
    metrics = learn(e, got)
    assert calls == [] and metrics["rollout/mismatch_kl"] is None  # nothing measured: the same numbers


def test_auto_trains_as_the_recomputed_pass_does(make_config):
    """The same seed, the same samples: an update anchored on the sampler's log-probs ends
    on the weights of one anchored on the recomputed pass (within float rounding)."""

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    weights = {}
    for mode in ("auto", "recompute"):
        e, c, stream = engine_for(make_config(rollout=FREE, train={**MOVING, "old_logprobs": mode}))
        start = {"all": flat(e.policy)}
        for step in range(2):
            train_step(e, stream.take(c.rollout.prompts_per_step), step=step)
        weights[mode] = {"all": flat(e.policy)}
        assert (weights[mode]["all"] - start["all"]).abs().max() > 1e-3  # it trained
    assert update_gap(start, weights["auto"], weights["recompute"]) < UPDATE


@pytest.mark.parametrize(
    "rollout, train",
    [
        (FREE, {**MOVING, "old_logprobs": "recompute"}),  # asked for
        ({"min_new_tokens": 0, "top_k": 5}, MOVING),  # the sampler drew from a truncated distribution
        ({"min_new_tokens": 2}, MOVING),  # EOS forbidden for the first tokens
        ({"min_new_tokens": 0, "sampler": "hf"}, MOVING),  # generate gives no log-probs
    ],
)
def test_auto_runs_the_pass_where_the_sampler_logprobs_are_not_the_trainers(make_config, monkeypatch, rollout, train):
    calls = _counting_policy_passes(monkeypatch)
    e, c, stream = engine_for(make_config(rollout=rollout, train=train))
    got = collect(e, stream.take(c.rollout.prompts_per_step))
    assert not e.old_logprobs_from_sampler(got.batch)
    learn(e, got)
    assert calls == [1]


@pytest.mark.parametrize("rollout", [FREE, {"min_new_tokens": 2}])  # exact log-probs or not
def test_auto_takes_the_samplers_logprobs_for_a_batch_that_earlier_weights_drew(make_config, monkeypatch, rollout):
    """Those weights are gone; the sampler's log-probs are the sampling policy's (docs/async.md)."""
    calls = _counting_policy_passes(monkeypatch)
    e, c, stream = engine_for(make_config(rollout=rollout, train=MOVING))
    first, second = (collect(e, stream.take(c.rollout.prompts_per_step), step=i) for i in range(2))
    learn(e, first)  # the first batch is the current weights': a pass where their log-probs are not exact
    assert e.old_logprobs_from_sampler(second.batch)
    passes = len(calls)
    learn(e, second)
    assert len(calls) == passes


def test_one_update_keeps_measuring_the_fast_loop_against_the_trainer(make_config):
    """With nothing moving the policy within the step, the update's own log-probs are the old
    ones, and the sampler's are measured against them (the mismatch metrics stay on)."""
    e, c, stream = engine_for(make_config(rollout=FREE))
    got = collect(e, stream.take(c.rollout.prompts_per_step))
    assert not e.old_logprobs_from_sampler(got.batch)
    metrics = learn(e, got)
    assert metrics["rollout/mismatch_kl"] is not None and metrics["rollout/mismatch_kl"] < 1e-6


def test_old_logprobs_sampler_refuses_generate_in_one_line(make_config):
    from grpo.errors import UserError

    with pytest.raises(UserError, match="train.old_logprobs: sampler needs a sampler that returns log-probs"):
        config_from_dict(make_config(rollout={"sampler": "hf"}, train={"old_logprobs": "sampler"}))
