"""verifiers v1 tasksets train (grpo.rollout.verifiers_env), through rollout.agent's endpoint.

- A taskset's tasks are the rows of a 'verifiers:ID' data.path, each with its prompt.
- A single-turn taskset and one whose task serves an MCP Toolset train a tiny model: each
  episode is verifiers' rollout with the in-process harness against the run's endpoint, its
  reward the taskset's own (recomputed here from the conversation the sample records), its
  metrics logged as agent/<name>; with the tool, the tool's result is in the conversation.
- A taskset that cannot load its tasks offline says that it needs the network, in one line.
"""

import asyncio
import json
import math

import pytest
import verifiers.v1 as vf

import grpo
from grpo.errors import UserError
from grpo.rollout.verifiers_env import agent, make_rows
from tests.rollout.tool_models import call, user
from tests.verifiers.serving import served
from tests.verifiers.tasksets import PROMPT, MultiplyToolset, digits

pytestmark = pytest.mark.verifiers

SINGLE = "verifiers:tests.verifiers.tasksets:MultiplyTaskset"
TOOL = "verifiers:tests.verifiers.tasksets:ToolTaskset"
AGENT = "grpo.rollout.verifiers_env:agent"


@pytest.fixture(scope="module")
def tool_url():
    with served(MultiplyToolset(vf.ToolsetConfig())) as url:
        yield url


def offered(url: str) -> list[dict]:
    """The tool schemas the harness offers the model: the MCP server's list, OpenAI's form."""
    from mcp import Client

    async def listed():
        async with Client(url) as client:
            return (await client.list_tools()).tools

    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in asyncio.run(listed())
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tool_url):
    """A tiny model taught (`grpo sft`) the task's conversation with the tool as the harness
    offers it: call multiply, then answer with its result."""
    from grpo.tasks.tiny import tiny_llama, tool_chat_tokenizer
    from grpo.train.sft import FineTuneConfig, sft

    directory = tmp_path_factory.mktemp("verifiers_model")
    tokenizer = tool_chat_tokenizer()
    tiny_llama(tokenizer, hidden_size=64, layers=2, heads=4, max_positions=2048, seed=0).save_pretrained(
        directory / "base"
    )
    tokenizer.save_pretrained(directory / "base")
    conversation = [*user(PROMPT), call("multiply", a=3, b=4), {"role": "tool", "name": "multiply", "content": "12"}]
    conversation.append({"role": "assistant", "content": "12"})
    (directory / "data.jsonl").write_text(json.dumps({"messages": conversation, "tools": offered(tool_url)}) + "\n")
    config = FineTuneConfig(
        model=str(directory / "base"),
        data=str(directory / "data.jsonl"),
        steps=120,
        batch_size=1,
        lr=3e-3,
        warmup_steps=0,
        max_grad_norm=0.0,
    )
    sft(directory / "model", config, progress=False, device="cpu")
    return str(directory / "model")


def train(tmp_path, model, path, task_options=None):
    config = {
        "model": model,
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": path, "task_options": task_options or {}},
        "rollout": {"agent": AGENT, "group_size": 4, "prompts_per_step": 1, "max_new_tokens": 96, "temperature": 0.7},
        "train": {"steps": 2, "lr": 1e-3, "sample_every": 1},
    }
    result = grpo.train(config, progress=False)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    return result.metrics, samples


def last_reply(sample) -> str:
    return next(m["content"] or "" for m in reversed(sample["messages"]) if m["role"] == "assistant")


def test_a_taskset_s_tasks_are_rows_with_their_prompt():
    rows = make_rows(SINGLE)
    assert [row["prompt"] for row in rows] == [user(PROMPT)]
    assert rows[0]["verifiers_task"] == 0


def test_a_single_turn_taskset_trains_with_its_own_rewards(tmp_path, model):
    metrics, samples = train(tmp_path, model, SINGLE)
    assert [m["step"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)
    assert len(samples) == 8
    for sample in samples:  # the trace's reward, as the taskset computes it from the reply
        assert sample["reward"] == pytest.approx(digits(last_reply(sample)), rel=1e-6, abs=1e-12)
    assert any(sample["reward"] > 0 for sample in samples)
    assert all(m["agent/turns"] == 1.0 for m in metrics)  # a @vf.metric, logged as agent/<name>


def test_a_taskset_with_a_toolset_tool_trains(tmp_path, model, tool_url):
    metrics, samples = train(tmp_path, model, TOOL, {"task": {"tools": {"url": tool_url}}})
    assert [m["step"] for m in metrics] == [1, 2]
    called = [s for s in samples if any(m["role"] == "tool" for m in s["messages"])]
    assert called, "the model called the tool in no episode"
    for sample in called:  # the toolset's answer reached the model
        assert [m["content"] for m in sample["messages"] if m["role"] == "tool"][0] == "12"
    for sample in samples:
        assert sample["reward"] == float("12" in last_reply(sample))
    assert any(sample["reward"] == 1.0 for sample in samples)


class OfflineTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    """Loads its tasks from a host this machine cannot reach."""

    def load(self):
        import socket

        socket.getaddrinfo("datasets.example.invalid", 443)
        return []


def test_a_taskset_that_needs_the_network_says_so_in_one_line():
    with pytest.raises(UserError, match="the taskset needs the network") as raised:
        make_rows("verifiers:tests.verifiers.test_verifiers:OfflineTaskset")
    assert "\n" not in str(raised.value)


def test_an_episode_whose_tool_server_is_on_an_unreachable_host_says_it_needs_the_network():
    (row,) = make_rows(TOOL, task_options={"task": {"tools": {"url": "http://tools.example.invalid/mcp"}}})
    with pytest.raises(RuntimeError, match="the taskset needs the network") as raised:  # before any model call
        asyncio.run(agent("http://127.0.0.1:9/v1", row, model="policy"))
    assert "\n" not in str(raised.value) and "tools.example.invalid" in str(raised.value)
