"""`grpo eval --tools / --environment`: pass@k and maj@k of multi-turn samples, on the tiny
model that calls TRL's documentation tools (tests/rollout/tool_models.py). With its tool the
model answers "What is 3 times 4?" right; without, its turn is an unanswered call."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.errors import UserError
from grpo.eval.command import EvalConfig, run
from grpo.eval.runner import evaluate, reward_verifier
from grpo.rollout.tools import Toolbox
from grpo.tasks import load_task
from tests.rollout.tool_models import INCREMENT_PROMPT, MULTIPLY_PROMPT, async_add, multiply


def right(completions, answer, **kwargs):
    """The last turn says the row's answer (a multi-turn sample is its messages)."""
    return [float(c[-1]["content"] == a) for c, a in zip(completions, answer)]


ROWS = [{"prompt": MULTIPLY_PROMPT, "answer": "12"}] * 2


@pytest.fixture(scope="module")
def tool_lm(tool_model):
    return AutoTokenizer.from_pretrained(tool_model), AutoModelForCausalLM.from_pretrained(tool_model).eval()


def test_with_its_tools_the_model_answers_and_the_votes_are_its_last_turn(tool_lm):
    tok, model = tool_lm
    verifier = reward_verifier(right, extract=str.strip)
    common = dict(n=4, ks=[1, 4], verifier=verifier, temperature=0.3, max_new_tokens=200, progress=False)
    with_tools = evaluate(model, tok, ROWS, tools=Toolbox([multiply, async_add]), **common)
    assert with_tools["pass@k"]["1"] > 0.5 and with_tools["maj@k"]["4"] == 1.0
    assert with_tools["per_prompt"][0]["answers"].get("12", 0) >= 3  # read from the last turn
    # Without tools the model's turn is a call no one answers: its last turn has no answer.
    no_tools = evaluate(model, tok, ROWS, **common)
    assert no_tools["pass@k"]["4"] == 0.0


def test_grpo_eval_takes_tools_and_an_environment_by_spec(tool_model, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "results.json"
    config = EvalConfig(
        model=tool_model,
        data=str(data),
        n=2,
        verifier="tests.eval.test_tools_eval:right",
        answer_pattern=r"^(\d+)$",
        temperature=0.3,
        max_new_tokens=200,
        tools="tests.rollout.tool_models:multiply, tests.rollout.tool_models:async_add",
        max_tool_calls=1,
    )
    assert run(config, load_task=load_task, device="cpu", out=str(out), progress=False) == 0
    results = json.loads(out.read_text())
    assert results["accuracy"] > 0.5 and results["no_answer"] < 0.5
    # An environment's methods are the tools; its reset reads the row.
    env_rows = tmp_path / "env.jsonl"
    env_rows.write_text(json.dumps({"prompt": INCREMENT_PROMPT, "answer": "Done.", "target": 2}) + "\n")
    config = EvalConfig(
        model=tool_model,
        data=str(env_rows),
        n=2,
        verifier="tests.eval.test_tools_eval:right",
        temperature=0.3,
        max_new_tokens=200,
        environment="tests.rollout.tool_models:DatasetIncrementEnv",
    )
    assert run(config, load_task=load_task, device="cpu", out=str(out), progress=False) == 0
    assert json.loads(out.read_text())["accuracy"] > 0.5


def test_tool_options_without_tools_are_refused_in_one_line(tool_model, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = EvalConfig(model=tool_model, data=str(data), verifier="tests.eval.test_tools_eval:right", max_tool_calls=2)
    with pytest.raises(UserError, match="--max-tool-calls: needs --tools or --environment"):
        run(config, load_task=load_task, device="cpu", progress=False)
