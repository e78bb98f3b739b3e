"""rollout.chat_template_kwargs (TRL's chat_template_kwargs, e.g. Qwen3's enable_thinking):
the chat template's own variables reach it wherever a prompt is rendered, single-turn
sampling and multi-turn rollouts with tools alike, and a config's TRL name points at it."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import RolloutConfig, config_from_dict
from grpo.errors import UserError
from grpo.rollout.sampler import Sampler
from grpo.rollout.tools import HermesFormat
from grpo.tasks.tiny import TOOL_CHAT_TEMPLATE, tool_chat_tokenizer

# A template variable as Qwen3's enable_thinking is one: a marker before the prompt when it is false.
THINK = "{% if enable_thinking is defined and not enable_thinking %}000 {% endif %}"
OFF = {"enable_thinking": False}


@pytest.mark.parametrize("kwargs, marked", [(OFF, True), ({}, False), ({"enable_thinking": True}, False)])
def test_single_turn_prompts_render_with_the_template_s_variables(tiny_model, kwargs, marked):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = THINK + "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    settings = RolloutConfig(group_size=2, max_new_tokens=4, chat_template_kwargs=kwargs)
    sampler = Sampler.from_config(tokenizer, settings, prompt_column="prompt", seed=0)
    rollout = sampler.sample(model, [{"prompt": [{"role": "user", "content": "ab"}]}])
    assert [p.startswith("000 ") for p in rollout.prompts] == [marked, marked], rollout.prompts
    assert all(p.endswith("ab ") for p in rollout.prompts)


def test_tool_turns_render_with_the_template_s_variables():
    tokenizer = tool_chat_tokenizer()
    tokenizer.chat_template = THINK + TOOL_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    assert HermesFormat(tokenizer, OFF).render(messages, None, generation=True).startswith("000 ")
    assert not HermesFormat(tokenizer).render(messages, None, generation=True).startswith("000 ")


def test_the_config_takes_them_and_trls_name_points_there():
    rollout = {"chat_template_kwargs": OFF}
    config = config_from_dict(
        {"model": "m", "data": {"path": "d"}, "rewards": [{"function": "x:y"}], "rollout": rollout}
    )
    assert config.rollout.chat_template_kwargs == OFF
    trl_name = {"model": "m", "data": {"path": "d"}, "rewards": [{"function": "x:y"}], "chat_template_kwargs": OFF}
    with pytest.raises(UserError, match="it is 'rollout.chat_template_kwargs' here"):
        config_from_dict(trl_name)
