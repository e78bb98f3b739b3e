"""Who owns an engine a decoder builds (vLLM's, `grpo.rollout.decoders.Engines`): the generator
that built it, which shares it among its samplers and shuts it down at `close`; a Sampler made
alone owns its own. A stand-in engine here (tests/vllm/test_generator.py builds vLLM's)."""

import pytest

from grpo.config import config_from_dict
from grpo.rollout import Sampler
from grpo.rollout.decoders import DecoderSettings, Engines
from grpo.rollout.generator import GeneratorSpec, LocalGenerator
from grpo.vllm import decoder as vllm_decoder
from grpo.vllm import engine as vllm_engine
from tests.rollout.test_fast import TOKENIZER, model_of


class Stand:
    """What the decoder's holder asks of an engine: to be closed."""

    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


@pytest.fixture
def built(monkeypatch):
    """The stand-in engines built meanwhile, in order (the vllm decoder admitted without vLLM)."""
    made = []
    monkeypatch.setattr(vllm_decoder, "local_engine", lambda *args: made.append(Stand()) or made[-1])
    monkeypatch.setattr(vllm_engine, "refusal", lambda *args: None)
    return made


def test_a_generator_s_samplers_share_the_engine_it_owns_and_shut_down_with_it(make_config, built):
    model = model_of()
    spec = GeneratorSpec.of(config_from_dict(make_config(rollout={"sampler": "vllm"})), autocast=None)
    spec.pairs = 3  # iterative RL's sampler beside training's
    first = LocalGenerator.of(spec, TOKENIZER, None)
    first.start(model)
    (engine,) = built  # one engine for both samplers
    assert [s.decoders["vllm"].engine for s in first.samplers.values()] == [engine, engine]
    first.close()
    assert engine.closed and first.engines.engine is None
    first.close()  # again: nothing
    second = LocalGenerator.of(spec, TOKENIZER, None)
    second.start(model)
    assert len(built) == 2 and not built[1].closed  # its own, not the closed one
    second.close()
    assert built[1].closed


def test_a_sampler_made_alone_owns_its_engine_and_one_given_a_holder_leaves_it_to_its_owner(built):
    model = model_of()
    made = dict(prompt_column="prompt", group_size=2, max_new_tokens=4, backend="vllm")
    alone = Sampler(TOKENIZER, **made)
    alone.start(model)
    alone.close()
    assert built[0].closed
    holder = Engines()
    given = Sampler(TOKENIZER, settings=DecoderSettings(engines=holder), **made)
    given.start(model)
    given.close()
    assert holder.engine is built[1] and not built[1].closed
    holder.close()
    assert built[1].closed
