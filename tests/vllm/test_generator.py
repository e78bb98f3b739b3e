"""The vLLM engine belongs to the generator that built it: training's and iterative RL's
samplers share it, the generator's `close` shuts it down, and the next generator builds its
own (tests/rollout/test_engine_owner.py checks the same with a stand-in engine)."""

import pytest

from grpo.config import config_from_dict
from grpo.rollout.generator import PAIRS, TRAIN, GeneratorSpec, LocalGenerator
from grpo.tasks.tiny import char_tokenizer
from tests.vllm.models import ALPHABET, build

pytestmark = pytest.mark.vllm

TOKENIZER = char_tokenizer(ALPHABET)
ROWS = [{"prompt": "ab"}, {"prompt": "hello"}]


def test_the_generator_s_samplers_share_its_engine_and_its_close_shuts_it_down(make_config, built_engines):
    policy = build("qwen2", TOKENIZER)
    rollout = {
        "sampler": "vllm",
        "max_prompt_length": 32,
        "max_new_tokens": 4,
        "min_new_tokens": 0,
        "vllm": {"max_num_seqs": 8},
    }
    spec = GeneratorSpec.of(config_from_dict(make_config(rollout=rollout)), autocast=None)
    spec.pairs = 3  # iterative RL's sampler beside training's
    first = LocalGenerator.of(spec, TOKENIZER, None)
    try:
        first.start(policy)
        (engine,) = built_engines  # one engine for both samplers
        assert [s.decoders["vllm"].engine for s in first.samplers.values()] == [engine, engine]
        first.publish(policy, 0)
        for purpose in (TRAIN, PAIRS):
            first.request(0, ROWS, purpose=purpose)
            assert first.take(0, purpose).sampled_logprobs is not None
        assert engine.holds[1] == 0 and engine.syncs == 1  # synced once, for both
    finally:
        first.close()
    assert engine.closed and first.engines.engine is None
    second = LocalGenerator.of(spec, TOKENIZER, None)
    try:
        second.start(policy)
        assert len(built_engines) == 2 and not built_engines[1].closed  # its own, not the one shut down
    finally:
        second.close()
    assert built_engines[1].closed
