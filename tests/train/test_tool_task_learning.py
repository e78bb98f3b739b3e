"""GRPO on the built-in multi-turn task learns to use its tool, from the outcome reward alone.

The base is warmed up with `grpo sft` on the task's chat template, for a few problems, on
two conversations each: one that calls multiply and answers with its result, one that
answers wrongly in the head. It then calls the tool about half the time, and is right only
when it does. GRPO, with the tool and the task's verifier as the only reward, must raise both
the reward and the calls per rollout (a planted sign flip of the group advantages fails it).
With so few problems the base knows each answer after its call by heart, so this checks
that the call is learned, not that its result is copied: `grpo demo --tools` shows that,
on held-out 2-digit problems, with a base that takes minutes to learn to copy (too long
for a test).
"""

import json

import pytest

import grpo
from grpo.tasks.multiply import multiply, save_base
from grpo.train.sft import FineTuneConfig, sft

pytestmark = pytest.mark.learning

PROBLEMS = [(3, 4), (6, 7), (8, 9), (5, 8)]
TOOL, REWARD = "grpo.tasks.multiply:multiply", "grpo.tasks.multiply:correctness_reward"


def warm_up_rows() -> list[dict]:
    from transformers.utils import get_json_schema

    schema = get_json_schema(multiply)
    rows = []
    for a, b in PROBLEMS:
        prompt = {"role": "user", "content": f"{a}*{b}"}
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        calls = [
            prompt,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
        in_the_head = [prompt, {"role": "assistant", "content": str(a * b + 1)}]
        rows += [{"messages": calls, "tools": [schema]}, {"messages": in_the_head, "tools": [schema]}]
    return rows


def mean(values):
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def warmed_base(tmp_path_factory):
    """The multiply task's base after its warm-up (`grpo sft`): calls the tool part of the time."""
    tmp_path = tmp_path_factory.mktemp("multiply")
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in warm_up_rows()))
    base = tmp_path / "base"
    warm_up = FineTuneConfig(
        model=str(save_base(tmp_path / "init")),
        data=str(data),
        steps=300,
        batch_size=8,
        lr=3e-3,
        warmup_steps=0,
        max_grad_norm=0.0,
    )
    sft(base, warm_up, progress=False, device="cpu")
    return base


@pytest.mark.parametrize("rollout", [{}, {"async": {"max_staleness": 1}}], ids=["sync", "async"])
def test_grpo_on_the_multiply_task_learns_to_call_its_tool(warmed_base, tmp_path, rollout):
    """The same with rollout.async (K = 1): the generator process runs the tool calls."""
    base = warmed_base
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)} for a, b in PROBLEMS]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "algorithm": "grpo",
        "model": str(base),
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(prompts)},
        "rewards": [{"function": REWARD}],
        "rollout": {
            "group_size": 8,
            "prompts_per_step": 4,
            "max_new_tokens": 96,
            "temperature": 1.0,
            "tools": [TOOL],
            "max_tool_calls": 1,
            **rollout,
        },
        "train": {"steps": 20, "lr": 3e-4, "gradient_checkpointing": False},
        "loss": {"beta": 0.04},
    }
    metrics = grpo.train(config, progress=False).metrics
    rewards = [m["reward/mean"] for m in metrics]
    calls = [m["tools/calls_per_rollout"] for m in metrics]
    # Step 1's samples are the base's: it calls the tool part of the time, and is right when it does.
    assert 0.1 < rewards[0] < 0.6 and 0.1 < calls[0] < 0.7, (rewards, calls)
    # At lr 3e-4 the reward is up within two or three steps and stays there; the last five
    # steps' mean against the base's step: +0.26 to +0.37 over seeds 0-3, sync and async, with
    # torch's AVX-512 kernels and with its AVX2 ones (ATEN_CPU_CAPABILITY=avx2); the advantages'
    # sign flipped: -0.31 to -0.38. (At lr 1e-3 some seeds collapse into malformed calls: a
    # reward of 0 from step 11 at seed 2, and the gain of five steps against five from -0.17 to
    # +0.31, which failed this test on torch's AVX2 kernels.)
    assert mean(rewards[-5:]) > rewards[0] + 0.15, rewards
    assert mean(calls[-3:]) > calls[0] + 0.3, calls
