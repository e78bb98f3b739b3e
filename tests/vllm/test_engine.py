"""The vLLM engine in the training process: its log-probs of the tokens it samples are the
trainer's (fp32: ~1e-5 a token, models.assert_same_logprobs) before any update and after
optimizer updates (the weight sync works: a tied head with Qwen2's biases, and an untied
Llama), at temperature and repetition penalty; its check catches a stale sync; one engine
serves every sampler given its holder."""

import copy
import random

import pytest
import torch

from grpo.errors import UserError
from grpo.rollout import Sampler
from grpo.rollout.decoders import Engines
from grpo.tasks.tiny import char_tokenizer
from grpo.train.models import apply_lora
from grpo.train.layouts import policy_logprobs
from grpo.vllm import decoder as vllm_decoder
from grpo.vllm.decoder import EngineOptions, VllmDecoder, engine_key, local_engine
from grpo.vllm.engine import StaleWeights, policy_weights
from tests.vllm.models import ALPHABET, WORST_GAP, assert_same_logprobs, build

pytestmark = pytest.mark.vllm

TOKENIZER = char_tokenizer(ALPHABET)
# Left padding differs per prompt; the long one fills a whole KV block (128 tokens on a CPU),
# which vLLM's prefix cache keeps (a sync must drop it: it holds the old weights' keys and values).
ROWS = [
    {"prompt": "ab"},
    {"prompt": "hello world"},
    {"prompt": "7"},
    {"prompt": "the quick brown fox jumps over a lazy dog " * 4},
]
OPTIONS = EngineOptions(max_model_len=192, max_num_seqs=16, seed=0)
ENGINES = Engines()  # the module's holder, as a generator's: every sampler below is given it


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def policy(request):
    """The module's model, with its engine built once into ENGINES and reused by every test."""
    model = build(request.param, TOKENIZER)
    before = (torch.get_rng_state(), random.getstate())
    ENGINES.get(engine_key(model, OPTIONS), lambda: local_engine(model, OPTIONS))
    model.streams_kept = torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    yield model
    ENGINES.close()


def sampler(**options):
    options = {"max_new_tokens": 12, **options}
    return Sampler(
        TOKENIZER,
        prompt_column="prompt",
        group_size=4,
        backend="vllm",
        seed=0,
        decoder_options={"vllm": {"options": OPTIONS, "engines": ENGINES}},
        **options,
    )


def assert_trainer_scores_the_samples(model, temperature=1.0, penalty=1.0, version=None):
    rollout = sampler(temperature=temperature, repetition_penalty=penalty).sample(model, ROWS, version=version)
    with torch.no_grad():
        scored = policy_logprobs(model, rollout, temperature, penalty)  # (N, T)
    valid = rollout.completion_mask.bool()
    assert valid.sum() > 20
    assert_same_logprobs(rollout.sampled_logprobs[valid], scored[valid])
    assert bool((rollout.sampled_logprobs[~valid] == 0).all())
    return rollout


def update(model, steps=2, lr=3e-2):
    """`steps` AdamW updates that move every weight (a loss on random tokens)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(len(TOKENIZER), (4, 16), generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.mark.parametrize(("temperature", "penalty"), [(1.0, 1.0), (0.7, 1.0), (1.0, 1.3), (0.7, 1.3)])
def test_the_engine_s_log_probs_are_the_trainer_s_before_any_update(policy, temperature, penalty):
    assert_trainer_scores_the_samples(policy, temperature, penalty)


def test_after_two_updates_the_synced_engine_still_scores_as_the_trainer(policy):
    before = assert_trainer_scores_the_samples(policy, 0.7, 1.3, version=0)
    engine = ENGINES.engine
    assert engine.holds[1] == 0
    update(policy)
    after = assert_trainer_scores_the_samples(policy, 0.7, 1.3, version=2)
    assert engine.holds[1] == 2
    # The weights moved: the old samples' log-probs under the new policy are not the old ones.
    with torch.no_grad():
        rescored = policy_logprobs(policy, before, 0.7, 1.3)
    valid = before.completion_mask.bool()
    assert (rescored[valid] - before.sampled_logprobs[valid]).abs().max() > 0.05
    assert after.policy_version == 2


def test_a_version_the_engine_holds_is_not_synced_again(policy, monkeypatch):
    engine = ENGINES.engine
    s = sampler()
    s.sample(policy, ROWS, version=7)
    calls = []
    monkeypatch.setattr(engine, "load_weights", lambda weights: calls.append(1))
    s.sample(policy, ROWS, version=7)
    sampler().sample(policy, ROWS, version=7)  # another sampler: the same engine, holding this version
    assert calls == []
    s.sample(policy, ROWS, version=8)
    s.sample(policy, ROWS)  # no version: the weights may have moved
    assert len(calls) == 2


def test_the_check_catches_a_sync_that_leaves_the_tied_head_stale(policy):
    """The spike's stale case: the weights sent without `lm_head.weight` and the head not
    repacked leave a tied head computing from the old embedding; the check refuses that."""
    engine = ENGINES.engine
    engine.sync(policy, check=True, tolerance=1e-3)
    assert engine.check(policy, 1e-3) < WORST_GAP
    update(policy, steps=1, lr=0.1)
    weights = [(n, t) for n, t in policy_weights(policy) if n != "lm_head.weight"]
    if policy.config.tie_word_embeddings:
        head = engine._worker().model_runner.model.lm_head
        repack = head.quant_method.process_weights_after_loading
        head.quant_method.process_weights_after_loading = lambda layer: None  # the planted bug: no repack
        try:
            engine.load_weights(weights)
        finally:
            head.quant_method.process_weights_after_loading = repack
        with pytest.raises(StaleWeights, match="the vLLM engine's weights are not the policy's"):
            engine.check(policy, 1e-3)
    engine.sync(policy, check=True, tolerance=1e-3)  # the real sync puts it right
    engine.holds = None


def test_truncation_gives_the_log_probs_of_the_distribution_drawn_from(policy):
    """With top-k and min-p (and min_new_tokens) the log-prob is under the truncated,
    renormalised distribution, as our fast loop gives it; the trainer scores the whole one."""
    rollout = sampler(temperature=0.8, top_k=5, min_p=0.05, min_new_tokens=4).sample(policy, ROWS)
    valid = rollout.completion_mask.bool()
    with torch.no_grad():
        whole = policy_logprobs(policy, rollout, 0.8)
    assert bool((rollout.sampled_logprobs[valid] >= whole[valid] - WORST_GAP).all())
    assert (rollout.sampled_logprobs[valid] - whole[valid]).max() > 0.05  # truncation raised them
    assert bool((rollout.completion_mask.sum(1) >= 4).all())  # EOS held back for 4 tokens


def test_a_seeded_sampler_draws_the_same_tokens_again(policy):
    first = sampler().sample(policy, ROWS, step=3)
    again = sampler().sample(policy, ROWS, step=3)
    other = sampler().sample(policy, ROWS, step=4)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_building_the_engine_leaves_the_global_random_streams_as_they_were(policy):
    assert policy.streams_kept  # vLLM seeds them; the trainer's draws must not depend on when it was built


def test_one_engine_serves_every_sampler_given_its_holder(policy):
    built = vllm_decoder.BUILT["engines"]
    for step in range(2):
        assert sampler().decoder(policy, 8).start(policy) is ENGINES.engine
        sampler().sample(policy, ROWS, step=step)
    assert vllm_decoder.BUILT["engines"] == built


def test_a_lora_policy_is_decoded_with_its_merged_weights(policy):
    """A peft-wrapped policy reaches the engine as W + scale * B @ A under the base model's
    names (the model itself left as it is), tied head included."""
    lora = apply_lora(copy.deepcopy(policy), r=4, alpha=8, target_modules="all-linear")
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: a delta of 0 would prove nothing
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
    names = [name for name, _ in policy_weights(lora)]
    assert names == [name for name, _ in policy_weights(policy)]
    rollout = assert_trainer_scores_the_samples(lora, 0.7, 1.3)
    assert not any("lora_B" in n and bool((p == 0).all()) for n, p in lora.named_parameters())
    with torch.no_grad():
        base = policy_logprobs(policy, rollout, 0.7, 1.3)
    valid = rollout.completion_mask.bool()
    assert (base[valid] - rollout.sampled_logprobs[valid]).abs().max() > 0.05  # the adapter counted


def test_options_vllm_cannot_sample_as_the_others_do_are_one_line():
    with pytest.raises(UserError, match=r"^rollout.sampler: vllm applies min_p before top_p .*; set one of them$"):
        VllmDecoder(sampler(top_p=0.9, min_p=0.1).params)
