"""The sampler's own random stream (issue 22, item 5): built with the run's seed, it draws each
step from a generator of (seed, rank, step), never from the global stream that the update's
permutations draw from."""

import copy

import pytest
import torch

from grpo.config import config_from_dict
from grpo.data import PromptStream, load_rows
from grpo.rewards import load_rewards
from grpo.rollout import Sampler
from grpo.train.loop import build_engine
from tests.helpers import run_generator, sampled_step
from tests.rollout.test_fast import ROWS, generate_drawn, model_of


def seeded(backend="fast", seed=7, rank=0):
    return generate_drawn(backend, temperature=1.3, seed=seed, rank=rank)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_sampling_and_the_update_s_permutation_draw_the_same_whichever_comes_first(backend):
    model = model_of(eos_bias=1.0)
    sampler = seeded(backend)

    def collect():
        return sampler.sample(model, ROWS, step=3).completions

    def learn():
        return torch.randperm(16)  # the update's minibatch order

    torch.manual_seed(0)
    tokens, order = collect(), learn()
    torch.manual_seed(0)
    order_first, tokens_after = learn(), collect()
    assert tokens == tokens_after and torch.equal(order, order_first)
    assert len(set(tokens)) > len(ROWS)  # the samples are not all alike


def test_the_stream_is_the_step_s_and_the_process_s_the_same_on_every_rebuild():
    model = model_of(eos_bias=1.0)
    first = seeded().sample(model, ROWS, step=3).completions
    assert seeded().sample(model, ROWS, step=3).completions == first  # a resumed run draws what it drew
    assert seeded().sample(model, ROWS, step=4).completions != first
    assert seeded(rank=1).sample(model, ROWS, step=3).completions != first
    assert seeded(seed=8).sample(model, ROWS, step=3).completions != first
    # Both decoders draw the same tokens from it, as from the global stream.
    assert seeded("hf").sample(model, ROWS, step=3).completions == first
    # Per-prompt seeds still decide alone.
    seeds = [11, 22, 33, 44]
    torch.manual_seed(0)
    unseeded = generate_drawn("auto", temperature=1.3)
    assert seeded().sample(model, ROWS, seeds, step=3).completions == unseeded.sample(model, ROWS, seeds).completions


def test_a_training_step_samples_from_the_run_s_stream_for_that_step(make_config, prompts_file):
    """The run's generator draws a step's samples from the stream of (seed, rank 0, step),
    whatever the global stream holds, and the step trains on them."""
    c = config_from_dict(make_config(seed=5, rollout={"min_new_tokens": 0}))
    e = build_engine(c, load_rewards([(r.function, r.weight) for r in c.rewards]))
    rows = PromptStream(load_rows(prompts_file, prompt_column="prompt"), seed=0).take(c.rollout.prompts_per_step)
    before = copy.deepcopy(e.policy)
    torch.manual_seed(123)
    sampled = sampled_step(e, run_generator(c, e), rows, step=6).rollout
    expected = Sampler.from_config(e.tokenizer, c.rollout, prompt_column="prompt", seed=5).sample(before, rows, step=6)
    assert sampled.completions == expected.completions
    assert sampled.policy_version == 0 and e.version == 1
