"""Multi-turn rollouts with tools on vLLM, through the same decoder seam as fast and hf: the
completion is the tokens vLLM sampled and the tool messages' tokens, the loss mask 1 on the
sampled ones only (tests/rollout/test_tools.py checks the same on fast and hf)."""

import pytest
import torch

from grpo.config import VllmConfig
from grpo.rollout.sampler import Sampler
from grpo.rollout.tools import Toolbox
from grpo.vllm.decoder import EngineOptions
from tests.rollout.test_tools import sampled_and_appended, spy_on
from tests.rollout.tool_models import MULTIPLY_PROMPT, async_add, multiply

pytestmark = pytest.mark.vllm


def test_vllm_samples_multi_turn_rollouts_with_the_tokens_as_sampled(tool_lm):
    tok, model = tool_lm
    engine = EngineOptions.of(VllmConfig(max_num_seqs=8), max_model_len=2048, seed=0)
    sampler = Sampler(
        tok,
        prompt_column="prompt",
        group_size=2,
        max_new_tokens=200,
        temperature=0.3,
        backend="vllm",
        seed=0,
        tools=Toolbox([multiply, async_add], timeout=5.0),
        decoder_options={"vllm": {"options": engine}},
    )
    records = spy_on(sampler, model)
    try:
        rollout = sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}], version=0)
    finally:
        sampler.close()  # the engine it built, its own
    assert rollout.tool_calls.tolist() == [1.0, 1.0]
    for i in range(len(rollout)):
        mask = sampled_and_appended(rollout, records, sampler, i)
        assert torch.equal(rollout.loss_mask[i, : len(mask)], mask) and rollout.loss_mask[i, len(mask) :].sum() == 0
        assert rollout.messages[i][1]["role"] == "tool"  # a call, answered (an error too, where it was written badly)
    assert (rollout.sampled_logprobs[rollout.completion_mask.bool() & (rollout.loss_mask == 0)] == 0).all()
