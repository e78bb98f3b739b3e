"""The decoder registry, the one SamplingParams every decoder samples by, and the log-probs
the fast loop returns with its tokens."""

import dataclasses
import typing

import pytest
import torch

from grpo.config import RolloutConfig, config_from_dict
from grpo.errors import UserError
from grpo.rollout import Sampler, decoders, fast
from grpo.rollout.decoders import DECODERS, NAMES, generation_config
from grpo.rollout.params import FAST_ONLY, OPTIONS
from grpo.train.layouts import policy_logprobs
from tests.helpers import assert_close_scaled
from tests.rollout.test_fast import ROWS, TOKENIZER, generate_drawn, model_of, recording_draws


def sampler(backend="fast", **options):
    return generate_drawn(backend, **options)


def test_the_config_takes_the_registry_s_names():
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["sampler"]) == NAMES == ("auto", *DECODERS)


# One value per option, none of them its default.
SET = dict(
    max_new_tokens=7,
    min_new_tokens=2,
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    min_p=0.1,
    repetition_penalty=1.2,
    draw="fast",
)


def test_one_sampling_params_carries_every_option_of_the_config_to_every_decoder(make_config):
    assert set(OPTIONS) == set(SET)  # an option added to SamplingParams is added to this test
    rollout = config_from_dict(make_config(rollout=SET)).rollout
    assert set(OPTIONS) <= {f.name for f in dataclasses.fields(RolloutConfig)}
    built = Sampler.from_config(TOKENIZER, rollout, prompt_column="prompt")
    assert {name: getattr(built.params, name) for name in OPTIONS} == SET
    assert (built.params.eos_token_ids, built.params.pad_token_id) == (
        (TOKENIZER.eos_token_id,),
        TOKENIZER.pad_token_id,
    )
    generate = generation_config(built.params)  # what `generate` is told: each option, under the same name
    assert {name: getattr(generate, name) for name in OPTIONS if name not in FAST_ONLY} == {
        name: value for name, value in SET.items() if name not in FAST_ONLY
    }
    assert generate.no_repeat_ngram_size == 0 and generate.do_sample
    assert (generate.eos_token_id, generate.pad_token_id) == ([TOKENIZER.eos_token_id], TOKENIZER.pad_token_id)
    # The options given one by one make the same params.
    assert sampler(**SET).params == built.params
    with pytest.raises(TypeError):
        Sampler(TOKENIZER, prompt_column="prompt", group_size=4, params=built.params, temperature=0.5)


def test_auto_takes_the_first_decoder_that_can_and_a_named_one_says_why_it_cannot():
    llama = model_of()
    assert decoders.choose("auto", llama, 20) == "fast"
    assert decoders.choose("hf", llama, 20) == "hf"
    window = model_of()
    window.config.sliding_window, window.config.use_sliding_window = 8, True
    assert decoders.choose("auto", window, 20) == "hf"  # fast cannot: the sequence outgrows the window
    assert decoders.choose("auto", window, 8) == "fast"
    with pytest.raises(UserError, match="rollout.sampler: fast cannot decode this model: sliding window"):
        decoders.choose("fast", window, 20)
    assert decoders.lora_refusal("hf") is None and decoders.lora_refusal("auto") is None
    assert decoders.lora_refusal("fast").startswith("rollout.sampler: fast cannot decode a LoRA-wrapped policy")


def test_each_decoder_builds_its_own_options_from_what_the_sampler_knows(make_config):
    """The Sampler hands every decoder the same settings (the rollout config, the seed, the
    spare memory); each derives its own constructor options: the engine's for vLLM (the
    longest sequence it holds, the request seed), the fast loop's spare bytes, none for
    `generate`. A caller's `decoder_options` replace them."""
    from grpo.vllm.decoder import EngineOptions

    rollout = config_from_dict(
        make_config(rollout={"max_prompt_length": 40, "max_new_tokens": 9, "vllm": {"max_num_seqs": 8}})
    ).rollout
    built = Sampler.from_config(TOKENIZER, rollout, prompt_column="prompt", seed=5, spare_bytes=123)
    held = {"engines": built.settings.engines}  # the holder its engine is built into (the Sampler's own here)
    assert built.options("vllm") == {"options": EngineOptions.of(rollout.vllm, max_model_len=49, seed=5), **held}
    assert built.options("vllm")["options"].max_num_seqs == 8
    assert built.options("fast") == {"spare_bytes": 123} and built.options("hf") == {}
    unlimited = dataclasses.replace(rollout, max_prompt_length=0)
    assert Sampler.from_config(TOKENIZER, unlimited, prompt_column="prompt").options("vllm")["options"] == (
        EngineOptions.of(rollout.vllm, max_model_len=None, seed=0)
    )  # the model's own positions; no seed: 0
    plain = sampler()  # built without a config: every decoder's defaults
    assert plain.options("vllm") == {"engines": plain.settings.engines} and plain.options("fast") == {"spare_bytes": 0}
    plain.decoder_options = {"fast": {"spare_bytes": 7}}
    assert plain.decoder(model_of(), 4).spare_bytes == 7


def test_a_decoder_declares_what_it_can_do_and_the_defaults_refuse(make_config):
    """`start` and `extend` are declared by every decoder: starting builds nothing ahead where
    there is nothing to build, and extending a kept cache is the fast loop's alone (a
    multi-turn rollout asks `extends`, never the attribute's presence). A worker's samplers
    hold a version's work between samples, given at construction."""
    model, s = model_of(), sampler("hf")
    s.start(model)  # nothing to build: no error, no engine
    hf = s.decoder(model, 4)
    assert not hf.extends and s.decoder_name(model, 4) == "hf"
    with pytest.raises(NotImplementedError, match="HFDecoder keeps no cache"):
        hf.extend(None, [], torch.ones(1), [None])
    assert sampler("fast").decoder(model, 4).extends
    rollout = config_from_dict(make_config()).rollout
    assert Sampler.from_config(TOKENIZER, rollout, prompt_column="prompt", hold_prepared=True).hold_prepared
    assert not Sampler.from_config(TOKENIZER, rollout, prompt_column="prompt").hold_prepared
    from grpo.rollout.generator import GeneratorSpec, samplers_of

    spec = GeneratorSpec.of(config_from_dict(make_config()), autocast=None)
    spec.pairs = 3  # iterative RL's sampler too
    held = samplers_of(spec, TOKENIZER, None, hold_prepared=True)  # a worker's
    assert len(held) == 2 and all(s.hold_prepared for s in held.values())
    assert not any(s.hold_prepared for s in samplers_of(spec, TOKENIZER, None).values())


def test_the_fast_loop_fuses_the_weights_once_per_policy_version(monkeypatch):
    calls = []
    real = fast.fuse_weights
    monkeypatch.setattr(fast, "fuse_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, s = model_of(), sampler(batch_size=6, hold_prepared=True)  # 16 completions in 3 decoding calls
    first = s.sample(model, ROWS, version=3)
    assert len(calls) == 1 and first.policy_version == 3
    s.sample(model, ROWS, version=3)
    assert len(calls) == 1  # the same version: its weights
    assert s.sample(model, ROWS, version=4).policy_version == 4
    assert len(calls) == 2
    s.sample(model, ROWS)
    s.sample(model, ROWS)
    assert len(calls) == 4  # no version: the weights may have moved
    s.sample(model_of(init=0.2), ROWS, version=4)
    assert len(calls) == 5  # another model


def test_by_default_the_fused_weights_do_not_outlive_a_sample(monkeypatch):
    """The fused copy of the weights is dropped when `sample` returns (it would otherwise sit
    in memory through the update), and built again, once, by the next sample."""
    calls = []
    real = fast.fuse_weights
    monkeypatch.setattr(fast, "fuse_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, s = model_of(), sampler(batch_size=6)  # 3 decoding calls a sample
    s.sample(model, ROWS, version=3)
    assert len(calls) == 1 and s.decoders["fast"].weights is None and s.decoders["fast"].policy is None
    s.sample(model, ROWS, version=3)
    assert len(calls) == 2


@pytest.mark.numerics
@pytest.mark.parametrize("penalty", [1.0, 1.5])
@pytest.mark.parametrize("batch_size", [0, 6])
def test_the_fast_loop_s_log_probs_are_those_a_forward_pass_gives_its_tokens(penalty, batch_size):
    """Without top-k/p and min-p, the distribution drawn from is the model's at the
    temperature (and penalty): one forward pass over prompt + completion scores each sampled
    token as the loop did when it drew it. 0 past each completion's end; generate gives none."""
    model = model_of(eos_bias=1.0)  # rows end at different steps
    torch.manual_seed(1)
    rollout = sampler(temperature=0.8, repetition_penalty=penalty, batch_size=batch_size).sample(model, ROWS)
    with torch.no_grad():
        scored = policy_logprobs(model, rollout, 0.8, penalty)  # (N, T)
    valid = rollout.completion_mask.bool()
    lengths = rollout.completion_lengths
    assert lengths.min() < lengths.max() == valid.shape[1]  # some rows end early
    assert rollout.sampled_logprobs.shape == valid.shape and rollout.sampled_logprobs.dtype == torch.float32
    assert_close_scaled(rollout.sampled_logprobs[valid], scored[valid])
    assert bool((rollout.sampled_logprobs[~valid] == 0).all())
    assert bool((rollout.sampled_logprobs[valid] < 0).all())
    torch.manual_seed(1)
    assert sampler("hf", temperature=0.8, repetition_penalty=penalty).sample(model, ROWS).sampled_logprobs is None


@pytest.mark.numerics
def test_with_truncation_the_log_probs_are_of_the_truncated_distribution(monkeypatch):
    """Under top-k, top-p and min-p the log-prob is the token's under the distribution the
    loop drew it from (renormalised after truncation), not the model's."""
    model = model_of(eos_bias=1.0)
    steps = []  # (N, V) log of each step's distribution
    monkeypatch.setattr(fast.decoding, "_draw", recording_draws(steps, fill=1.0, log=True))
    options = dict(temperature=1.4, top_k=4, top_p=0.9, min_p=0.2, repetition_penalty=1.5, min_new_tokens=3)
    torch.manual_seed(1)
    rollout = sampler(**options).sample(model, ROWS)
    drawn = torch.stack(steps, 1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)  # (N, T)
    valid = rollout.completion_mask.bool()
    assert_close_scaled(rollout.sampled_logprobs[valid], drawn[valid])
    with torch.no_grad():
        untruncated = policy_logprobs(model, rollout, 1.4, 1.5)
    assert (rollout.sampled_logprobs[valid] - untruncated[valid]).max() > 0.05  # truncation raised them
