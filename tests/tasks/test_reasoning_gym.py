"""reasoning-gym as a data source: the 'reasoning_gym:NAME?size=N&seed=S' spec wherever a data
path goes, the built-in reward `reasoning_gym` and the task that checks such rows in
`grpo eval` (issue 13, point 7). benchmarks/gym_tasks.py runs the same checks over every task
name the library lists."""

import builtins
import json
import math

import pytest

import grpo
from grpo.cli import main
from grpo.compare import aligned_configs
from grpo.config import config_from_dict, config_to_dict
from grpo.data import load_rows
from grpo.errors import UserError
from grpo.eval.command import data_task
from grpo.tasks import load_task
from grpo.tasks import reasoning_gym as gym
from grpo.tasks.tiny import save_tiny_model

pytest.importorskip("reasoning_gym")

# Tasks that generate fast, with short questions and one right answer each.
NAMES = ["basic_arithmetic", "chain_sum", "leg_counting", "letter_counting", "spell_backward", "word_sorting"]


def columns_of(rows):
    """The rows as the trainer hands them to a reward: one list per column but the prompt."""
    return {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}


def scores(rows, completions):
    return gym.reward(prompts=[row["prompt"] for row in rows], completions=completions, **columns_of(rows))


def one_line(fn, *args, **kwargs):
    with pytest.raises(UserError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", NAMES)
def test_rows_of_a_spec_are_the_tasks_and_its_seed_picks_them(name):
    rows = load_rows(f"reasoning_gym:{name}?size=64&seed=1")
    assert len(rows) == 64
    entries = gym._library().create_dataset(name, size=64, seed=1)
    for i, row in enumerate(rows):
        entry = entries[i]
        assert row["prompt"] == entry["question"] and row["answer"] == row["completion"] == entry["answer"]
        assert row["reasoning_gym_task"] == name and row["reasoning_gym_options"] == {"size": 64, "seed": 1}
        assert row["metadata"]["source_index"] == i
        json.dumps(row["metadata"])  # JSON-safe (tuples became lists)
    assert load_rows(f"reasoning_gym:{name}?size=64&seed=1") == rows
    assert [r["prompt"] for r in load_rows(f"reasoning_gym:{name}?size=64&seed=1000")] != [r["prompt"] for r in rows]


@pytest.mark.parametrize("name", NAMES)
def test_the_reward_scores_the_true_answer_1_and_a_wrong_one_less(name):
    rows = load_rows(f"reasoning_gym:{name}?size=64&seed=1")
    answers = [row["answer"] for row in rows]
    assert scores(rows, answers) == [1.0] * 64
    assert scores(rows, [f"thinking...\n<answer> {a} </answer>" for a in answers]) == [1.0] * 64
    # Conversational completions, as TRL passes them for chat prompts.
    assert scores(rows, [[{"role": "assistant", "content": f"<answer>{a}</answer>"}] for a in answers]) == [1.0] * 64
    # Another row's answer (where it differs) and a made-up one: wrong.
    shifted = [(i, answers[(i + 1) % 64]) for i in range(64) if answers[(i + 1) % 64] != answers[i]]
    assert len(shifted) > 32
    wrong = scores(rows, [dict(shifted).get(i, "nonsense") for i in range(64)])
    assert all(s < 1.0 for s in wrong), wrong
    assert all(s < 1.0 for s in scores(rows, ["<answer>nonsense</answer>"] * 64))


def test_rows_saved_as_json_without_the_entry_still_score():
    rows = load_rows("reasoning_gym:leg_counting?size=8&seed=3")
    saved = [json.loads(json.dumps({k: v for k, v in row.items() if k != "reasoning_gym_entry"})) for row in rows]
    assert scores(saved, [row["answer"] for row in saved]) == [1.0] * 8
    assert all(s < 1.0 for s in scores(saved, ["1"] * 8))


def test_rows_of_other_data_cannot_be_scored():
    assert gym.reward(prompts=["q", "q"], completions=["1", "2"], answer=["1", "1"]) == [None, None]
    assert gym.reward(prompts=["q"], completions=["1"], tag=["x"]) == [None]


def test_options_in_the_spec_and_in_task_options_are_the_same_and_shape_the_rows():
    by_spec = load_rows("reasoning_gym:chain_sum?size=16&seed=2&min_digits=3&max_digits=3&max_terms=2")
    by_config = load_rows(
        "reasoning_gym:chain_sum?size=16&seed=2", task_options={"min_digits": 3, "max_digits": 3, "max_terms": 2}
    )
    assert by_spec == by_config
    assert all(row["metadata"]["num_digits"] == 3 and row["metadata"]["num_terms"] == 2 for row in by_spec)
    assert by_spec[0]["reasoning_gym_options"] == {
        "min_digits": 3,
        "max_digits": 3,
        "max_terms": 2,
        "size": 16,
        "seed": 2,
    }
    assert scores(by_spec, [row["answer"] for row in by_spec]) == [1.0] * 16


def test_format_chat_makes_the_prompt_a_user_message_and_prompt_column_names_it():
    text = load_rows("reasoning_gym:spell_backward?size=4")
    chat = load_rows("reasoning_gym:spell_backward?size=4&format=chat")
    assert [row["prompt"] for row in chat] == [[{"role": "user", "content": row["prompt"]}] for row in text]
    assert scores(chat, [[{"role": "assistant", "content": row["answer"]}] for row in chat]) == [1.0] * 4
    renamed = load_rows("reasoning_gym:spell_backward?size=4", prompt_column="question")
    assert [row["question"] for row in renamed] == [row["prompt"] for row in text] and "prompt" not in renamed[0]


def test_defaults_are_documented_ones():
    spec = gym.parse_spec("reasoning_gym:chain_sum")
    assert (spec.size, spec.seed, spec.format, spec.options) == (gym.DEFAULT_SIZE, gym.DEFAULT_SEED, "text", {})
    assert len(load_rows("reasoning_gym:chain_sum")) == gym.DEFAULT_SIZE == 500


@pytest.mark.parametrize(
    "spec, options, message",
    [
        (
            "reasoning_gym:chain_sun",
            None,
            "data.path: reasoning-gym has no task 'chain_sun'; close names: chain_sum, decimal_chain_sum",
        ),
        ("reasoning_gym:", None, "data.path: 'reasoning_gym:' names no task; expected 'reasoning_gym:NAME'"),
        ("reasoning_gym:qqqqqq", None, "data.path: reasoning-gym has no task 'qqqqqq' (tasks: ab, acre, "),
        ("reasoning_gym:chain_sum?size=0", None, "size must be a positive integer, got 0"),
        ("reasoning_gym:chain_sum?size=2.5", None, "size must be a positive integer, got 2.5"),
        ("reasoning_gym:chain_sum?seed=-1", None, "seed must be an integer >= 0, got -1"),
        ("reasoning_gym:chain_sum?seed=x", None, "seed must be an integer >= 0, got 'x'"),
        ("reasoning_gym:chain_sum?size", None, "expected KEY=VALUE after '?', got 'size'"),
        ("reasoning_gym:chain_sum?seed=1&seed=2", None, "'seed' is given twice"),
        ("reasoning_gym:chain_sum?format=chatt", None, "format must be text or chat, got 'chatt'"),
        (
            "reasoning_gym:chain_sum?min_digit=2",
            None,
            "task 'chain_sum' has no option 'min_digit' (did you mean 'min_digits'? "
            "options: min_terms, max_terms, min_digits, max_digits, allow_negation)",
        ),
        (
            "reasoning_gym:chain_sum?min_digits=0",
            None,
            "task 'chain_sum' rejects the options {'min_digits': 0, 'size': 500, "
            "'seed': 0} (min_digits must be positive)",
        ),
        ("reasoning_gym:chain_sum", {"min_digit": 2}, "data.task_options: task 'chain_sum' has no option 'min_digit'"),
        (
            "reasoning_gym:chain_sum",
            {"seed": 2},
            "data.task_options: 'seed' belongs in data.path: 'reasoning_gym:chain_sum?seed=...'",
        ),
        (
            "reasoning_gym:chain_sum?min_digits=2",
            {"min_digits": 2},
            "data.task_options: 'min_digits' is also given in data.path",
        ),
        (
            "prompts.jsonl",
            {"min_digits": 2},
            "data.task_options: only a 'reasoning_gym:NAME' or 'verifiers:NAME' data.path takes task options",
        ),
    ],
)
def test_mistakes_are_one_line(spec, options, message):
    assert message in one_line(load_rows, spec, task_options=options)


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_gym(name, *args, **kwargs):
        if name == "reasoning_gym" or name.startswith("reasoning_gym."):
            raise ImportError("No module named 'reasoning_gym'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gym)
    assert one_line(load_rows, "reasoning_gym:chain_sum") == (
        "reasoning_gym: needs the reasoning-gym package: pip install 'grpo[gym]'"
    )


def test_the_builtin_reward_and_task_are_these():
    from grpo.rewards import resolve_reward

    assert resolve_reward("reasoning_gym") is gym.reward
    task = load_task("reasoning_gym")
    assert task is gym.task and task.verifier is gym.reward and task.threshold == 1.0
    # The votes of maj@k: what the reward scores, None for nothing.
    assert [
        task.extract_answer(c)
        for c in ["<answer> 42 </answer>", " 42\n", "a <answer>1</answer> <answer>7</answer>", "  "]
    ] == ["42", "42", "7", None]


def test_the_data_source_is_registered_with_data_by_its_prefix():
    from grpo import data
    from grpo.infra.imports import import_callable

    assert data.REASONING_GYM == gym.PREFIX
    assert import_callable(data.SOURCES[gym.PREFIX], kind="data source") is gym.make_rows


# ---- wherever a data path goes -----------------------------------------------------------------


def test_the_config_takes_task_options_and_compare_aligns_them(make_config):
    config = config_from_dict(
        make_config(data={"path": "reasoning_gym:chain_sum?size=8"}),
        ["data.task_options.min_digits=2", "data.task_options.allow_negation=true"],
    )
    assert config.data.task_options == {"min_digits": 2, "allow_negation": True}
    with pytest.raises(UserError, match="data.task_options: expected a mapping, got 3"):
        config_from_dict(make_config(data={"path": "reasoning_gym:chain_sum", "task_options": 3}))
    a = config_to_dict(config)
    b, changed = aligned_configs(
        a, config_to_dict(config_from_dict(make_config(data={"path": "reasoning_gym:chain_sum?size=8"})))
    )
    assert b["data"]["task_options"] == {"min_digits": 2, "allow_negation": True}
    assert any(line.startswith("data.task_options") for line in changed)


def test_eval_data_takes_the_spec_and_checks_it_with_the_tasks_scorer(tmp_path, capsys):
    assert data_task("reasoning_gym:basic_arithmetic?size=4&seed=1") is None  # not 'TASK:N'
    assert data_task("arithmetic:4") == ("arithmetic", "4")
    model = str(
        save_tiny_model(
            tmp_path / "model", "0123456789+-*/=. abcdefghijklmnopqrstuvwxyz", hidden_size=32, layers=1, heads=2
        )
    )
    out = tmp_path / "results.json"
    spec = "reasoning_gym:basic_arithmetic?size=3&seed=1"
    code = main(
        ["eval", "--model", model, "--data", spec, "--n", "2", "--max-new-tokens", "4", "--out", str(out), "--quiet"]
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text())
    assert results["data"] == spec and results["prompts"] == 3
    rows = load_rows(spec)
    assert [p["prompt"] for p in results["per_prompt"]] == [row["prompt"] for row in rows]
    # The verifier is the reasoning_gym task's: right answers pass, wrong ones fail.
    from grpo.eval.command import _verifier
    from argparse import Namespace

    args = Namespace(
        data=spec, task=None, verifier=None, answer=None, answer_pattern=None, threshold=None, prompt_column="prompt"
    )
    verifier = _verifier(args, rows, load_task)
    assert [verifier.check(f"<answer>{row['answer']}</answer>", row) for row in rows] == [True] * 3
    assert [verifier.check(row["answer"] + "1", row) for row in rows] == [False] * 3
    assert main(["eval", "--model", model, "--data", "reasoning_gym:chain_sun", "--quiet"]) == 2
    assert "--data: reasoning-gym has no task 'chain_sun'; close names: chain_sum" in capsys.readouterr().err


def test_a_short_grpo_run_on_the_spec_with_the_reward(make_config, tmp_path):
    spec = "reasoning_gym:basic_arithmetic?size=16&seed=1"
    config = make_config(
        data={"path": spec, "task_options": {"max_terms": 2, "max_digits": 1}},
        rewards=[{"function": "reasoning_gym"}],
        rollout={"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 4, "min_new_tokens": 0},
        train={"steps": 2, "lr": 1e-3, "sample_every": 1},
    )
    result = grpo.train(config, progress=False)
    assert len(result.metrics) == 2
    assert all(0.0 <= m["reward/reasoning_gym"] <= 1.0 for m in result.metrics)
    # What the run logged as each sample's reward is the task's score of that completion.
    rows = {row["prompt"]: row for row in load_rows(spec, task_options={"max_terms": 2, "max_digits": 1})}
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples
    for sample in samples:
        expected = scores([rows[sample["prompt"]]], [sample["completion"]])[0]
        assert math.isclose(sample["reward"], expected), sample


def test_sft_data_takes_the_spec_and_learns_its_answers(tmp_path, capsys):
    """grpo sft --data 'reasoning_gym:...' warms up on the task's answers as completions."""
    model = str(
        save_tiny_model(
            tmp_path / "model", "0123456789+-*/=. abcdefghijklmnopqrstuvwxyz:S", hidden_size=32, layers=1, heads=2
        )
    )
    spec = "reasoning_gym:chain_sum?size=16&seed=0&max_terms=2&max_digits=1"
    out = tmp_path / "warm"
    code = main(
        [
            "sft",
            "--model",
            model,
            "--data",
            spec,
            "--output",
            str(out),
            "--steps",
            "20",
            "--batch-size",
            "8",
            "--lr",
            "3e-3",
            "--quiet",
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["rows"] == 16 and summary["steps"] == 20
    assert summary["loss/last"] < 0.8 * summary["loss/first"]  # it learns the answers
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
