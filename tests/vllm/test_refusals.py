"""What vLLM cannot run is one line, before the first step."""

import pytest

import grpo
from grpo.errors import UserError

pytestmark = pytest.mark.vllm


def test_a_head_size_the_cpu_attention_refuses_is_one_line_before_the_first_step(make_config, tmp_path):
    config = make_config(rollout={"sampler": "vllm"})  # the tests' tiny Llama: head_dim 16
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    message = str(err.value)
    assert message.startswith("rollout.sampler: vllm cannot decode this model: vLLM's CPU attention takes head_dim")
    assert "this model's is 16" in message and "\n" not in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
