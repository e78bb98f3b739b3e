"""Agent rollouts on vLLM, through the same decoder seam as fast and hf: an agent's two-request
episode (a tool call, then the answer) becomes one sample whose log-probs, as the endpoint
returned and recorded them, are the engine's of the tokens it sampled and match the
trainer's as the engine's do (tests/rollout/test_endpoint.py checks the same on fast)."""

import pytest
import torch

from grpo.config import VllmConfig
from grpo.rollout.sampler import Sampler
from grpo.train.layouts import policy_logprobs
from grpo.vllm.decoder import EngineOptions
from tests.rollout.test_endpoint import ROW, MultiplyAgent
from tests.vllm.models import assert_same_logprobs

pytestmark = pytest.mark.vllm


def test_vllm_serves_an_agent_s_episode_with_the_log_probs_it_sampled(tool_lm):
    tok, model = tool_lm
    engine = EngineOptions.of(VllmConfig(max_num_seqs=8), max_model_len=2048, seed=0)
    agent = MultiplyAgent()
    sampler = Sampler(
        tok,
        prompt_column="prompt",
        group_size=2,
        max_new_tokens=200,
        temperature=0.3,
        backend="vllm",
        seed=0,
        agent=agent,
        decoder_options={"vllm": {"options": engine}},
    )
    try:
        rollout = sampler.sample(model, [ROW], version=0)
    finally:
        sampler.close()  # the engine it built, its own
    assert [r.reward for r in rollout.environments] == [1.0, 1.0]
    actions = rollout.loss_mask.bool()
    assert 0 < int(actions.sum()) < int(rollout.completion_mask.sum())  # the tool message is out of the loss
    for url, answers in agent.answers.items():
        i = int(url.split("/episodes/")[1].split("-")[1])
        returned = [e["logprob"] for a in answers for e in a["choices"][0]["logprobs"]["content"]]
        assert torch.equal(torch.tensor(returned, dtype=torch.float32), rollout.sampled_logprobs[i][actions[i]])
    assert_same_logprobs(rollout.sampled_logprobs[actions], policy_logprobs(model, rollout, 0.3)[actions])
