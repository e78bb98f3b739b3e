"""Training on agent programs' episodes (rollout.agent): a plain-Python agent that plays a
two-turn game against the endpoint, scoring each episode itself, trains a tiny model whose
reward rises; a short run logs the agent's metrics and its samples' conversations."""

import json
import urllib.request

import pytest
import yaml

import grpo
from grpo.tasks.tiny import save_tiny_tool_model

DIGITS = set("0123456789")


def ask(base_url: str, messages: list[dict], model: str) -> str:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"] or ""


def digits(base_url, row, *, model):
    """Guess my number, twice: the reward is the share of digits among the first four
    characters of each answer (learnable from scratch, as tests/train/rewards_for_tests.py's
    sevens is); the first turn's share is a metric of its own."""
    messages = list(row["prompt"])
    first = ask(base_url, messages, model)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
    second = ask(base_url, messages, model)
    shares = [sum(c in DIGITS for c in text[:4]) / 4 for text in (first, second)]
    return {"reward": sum(shares) / 2, "metrics": {"first": shares[0]}}


def guess(base_url, row, *, model):
    """An agent for configs that only need one to name (the refusal table's trigger)."""
    return None


@pytest.fixture(scope="module")
def random_tool_model(tmp_path_factory):
    return str(save_tiny_tool_model(tmp_path_factory.mktemp("agent_model"), hidden_size=64, layers=2, heads=4))


def config(model, tmp_path, steps, **train):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Guess my number, game {i}."}], "game": i} for i in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "algorithm": "grpo",
        "model": model,
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(data)},
        "rewards": [],
        "rollout": {
            "group_size": 8,
            "prompts_per_step": 2,
            "max_new_tokens": 32,
            "agent": "tests.train.test_agent:digits",
        },
        "train": {"steps": steps, "lr": 3e-3, "sample_every": 1, **train},
        "loss": {"beta": 0.0},
    }


@pytest.mark.parametrize(
    "rollout",
    [{}, pytest.param({"async": {"max_staleness": 1}}, marks=pytest.mark.slow)],
    ids=["sync", "async"],
)
def test_a_run_on_an_agent_s_episodes_logs_its_metrics_and_conversations(random_tool_model, tmp_path, rollout):
    """With rollout.async the agents run in the generator's process, which imports the agent
    by its spec, and their results travel to the trainer with the batch."""
    given = config(random_tool_model, tmp_path, 2)
    given["rollout"].update(agent=digits, **rollout)  # a function, from Python
    result = grpo.train(given, progress=False)
    written = yaml.safe_load((result.output_dir / "config.yaml").read_text())
    assert written["rollout"]["agent"] == "tests.train.test_agent:digits"
    for m in result.metrics:
        assert m["agent/failed"] == 0.0 and 0.0 <= m["agent/first"] <= 1.0
        assert m["reward/agent"] == pytest.approx(m["reward/mean"])
        assert 0.0 < m["tools/mask_fraction"] < 1.0  # the user's "Again." is in the sample, out of the loss
    samples = [json.loads(line) for line in (result.output_dir / "samples.jsonl").read_text().splitlines()]
    conversation = samples[0]["messages"] if "messages" in samples[0] else samples[0]["completion"]
    assert any(m.get("content") == "Again." for m in conversation), conversation


@pytest.mark.learning
def test_grpo_learns_from_an_agent_s_own_rewards(random_tool_model, tmp_path):
    result = grpo.train(config(random_tool_model, tmp_path, 30, sample_every=0), progress=False)
    rewards = [m["reward/mean"] for m in result.metrics]
    assert sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5 >= 0.2, [round(r, 3) for r in rewards]
