import json
import re
import sys

import pytest
import torch

from grpo.cli import build_parser
from grpo.errors import UserError
from grpo.eval.command import TASK_SEED, load_data, parse_ks
from grpo.tasks import load_task
from grpo.tasks.arithmetic import ALPHABET, make_rows
from grpo.tasks.tiny import save_tiny_model
from tests.tasks import user_task

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def explodes(completion):
    """An answer extractor that raises, as a user's buggy one would."""
    raise ValueError("cannot read this")


def parser():
    return build_parser()


def run(capsys, *argv):
    """As `grpo eval ...` would: (exit code, stdout, stderr); a UserError is one line, exit 2."""
    args = parser().parse_args(["eval", *argv])
    try:
        code = args.handler(args)
    except UserError as err:
        print(f"grpo: error: {err}", file=sys.stderr)
        code = 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eval-cmd-model")
    return str(save_tiny_model(directory, ALPHABET, hidden_size=32, layers=1, heads=2))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eval_prints_a_table_and_a_json_last_line_and_writes_out_and_plot(model_dir, tmp_path, capsys):
    out, plot = tmp_path / "res" / "results.json", tmp_path / "curves.png"
    code, stdout, _ = run(
        capsys,
        "--model",
        model_dir,
        "--data",
        "arithmetic:4",
        "--n",
        "4",
        "--k",
        "4,1,2",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--plot",
        str(plot),
        "--quiet",
    )
    assert code == 0
    lines = stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert "per_prompt" not in summary
    assert summary["n"] == 4 and summary["prompts"] == 4 and summary["data"] == "arithmetic:4"
    assert list(summary["pass@k"]) == ["1", "2", "4"] == list(summary["maj@k_ci"])
    assert lines[1].split() == ["k", "pass@k", "maj@k"]
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "4"]
    full = json.loads(out.read_text())
    assert len(full["per_prompt"]) == 4 and {k: v for k, v in full.items() if k != "per_prompt"} == summary
    assert [p["prompt"] for p in full["per_prompt"]] == [r["prompt"] for r in make_rows(4, seed=TASK_SEED)]
    assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000


def test_default_ks_are_the_powers_of_two_up_to_n(model_dir, capsys):
    code, stdout, err = run(capsys, "--model", model_dir, "--data", "arithmetic:2", "--n", "6", "--max-new-tokens", "4")
    assert code == 0
    assert list(json.loads(stdout.strip().splitlines()[-1])["pass@k"]) == ["1", "2", "4"]
    assert "completion" in err  # the progress bar, without --quiet


def test_a_reward_function_as_verifier(model_dir, tmp_path, capsys):
    argv = [
        "--model",
        model_dir,
        "--data",
        "arithmetic:2",
        "--n",
        "2",
        "--max-new-tokens",
        "4",
        "--quiet",
        "--verifier",
        "tests.eval.test_command:seven_tenths",
    ]
    summary = json.loads(run(capsys, *argv)[1].strip().splitlines()[-1])
    # Every completion scores 0.7 >= 0.5: all correct, but none has an <answer> to vote with.
    assert summary["accuracy"] == 1.0 and summary["pass@k"]["2"] == 1.0
    assert summary["maj@k"]["1"] == 0.0 and summary["no_answer"] == 1.0
    summary = json.loads(run(capsys, *argv, "--threshold", "0.8")[1].strip().splitlines()[-1])
    assert summary["accuracy"] == 0.0


def seven_tenths(prompts, completions, **_):
    return [0.7] * len(completions)


def _user_task_results(capsys, model, tmp_path, *argv):
    """`grpo eval` of `model` on 3 rows of the user's task (tests/tasks/user_task.py), with the
    full results; each prompt's count of correct completions is checked against its answers."""
    out = tmp_path / "results.json"
    code, _, err = run(
        capsys,
        "--model",
        model,
        "--data",
        "tests.tasks.user_task:task:3",
        "--n",
        "6",
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
        "--quiet",
        *argv,
    )
    assert code == 0, err
    results = json.loads(out.read_text())
    rows = user_task.rows(3, seed=TASK_SEED)
    assert [p["prompt"] for p in results["per_prompt"]] == [r["prompt"] for r in rows]
    return results, rows


def _judged_by_the_user_task(results, rows) -> bool:
    """Whether every verdict and every vote is the user task's: answers are first characters,
    and a completion is correct exactly when its answer is not the row's `avoid` letter."""
    return all(
        all(len(answer) == 1 for answer in p["answers"])
        and p["correct"] == sum(count for answer, count in p["answers"].items() if answer != row["avoid"])
        for p, row in zip(results["per_prompt"], rows)
    )


@pytest.mark.parametrize(
    "check", [["--task", "tests.tasks.user_task:task"], [], ["--task", "tests.tasks.user_task:make_task"]]
)
def test_a_users_task_checks_the_answers(tiny_model, tmp_path, capsys, check):
    """--task SPEC, or no --task with --data 'TASK:N': the task's verifier and its extractor."""
    results, rows = _user_task_results(capsys, tiny_model, tmp_path, *check)
    assert results["accuracy"] > 0  # no other verifier gives any of these completions credit
    assert _judged_by_the_user_task(results, rows)


def test_a_tasks_threshold_can_be_overridden(tiny_model, tmp_path, capsys):
    results, _ = _user_task_results(
        capsys, tiny_model, tmp_path, "--task", "tests.tasks.user_task:task", "--threshold", "1.5"
    )
    assert results["accuracy"] == 0.0 and any(p["answers"] for p in results["per_prompt"])


def test_a_users_verifier_with_its_answer_extractor(tiny_model, tmp_path, capsys):
    results, rows = _user_task_results(
        capsys,
        tiny_model,
        tmp_path,
        "--verifier",
        "tests.tasks.user_task:verify",
        "--answer",
        "tests.tasks.user_task:extract",
    )
    assert results["accuracy"] > 0
    assert _judged_by_the_user_task(results, rows)
    # Without --answer the answers are read by grpo.rewards.rules.extract_answer: none here.
    results, rows = _user_task_results(capsys, tiny_model, tmp_path, "--verifier", "tests.tasks.user_task:verify")
    assert results["no_answer"] == 1.0 and results["accuracy"] > 0


def test_arithmetic_data_is_fixed_and_files_load(tmp_path):
    rows = load_data("arithmetic:5", "prompt", load_task)
    assert rows == make_rows(5, seed=TASK_SEED) == load_data("grpo.tasks.arithmetic:task:5", "prompt", load_task)
    assert load_data("arithmetic:2", "question", load_task)[0].keys() == {"question", "answer", "solution"}
    assert load_data("tests.tasks.user_task:task:3", "prompt", load_task) == user_task.rows(3, seed=TASK_SEED)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    assert load_data(str(path), "prompt", load_task) == [{"prompt": "1+2=", "answer": "3"}]


def test_rows_the_verifier_cannot_score_are_a_warning_when_some_can_be_scored(tmp_path, capsys):
    from grpo.eval.command import _verifier

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "what?"}\n')
    args = parser().parse_args(["eval", "--model", "m", "--data", str(path)])
    verifier = _verifier(args, load_data(str(path), "prompt", load_task), load_task)
    assert verifier.check_all(["0+1+0=03>3"], {"prompt": "1+2=", "answer": "3"}) == [True]
    assert capsys.readouterr().err == (
        "grpo eval: warning: task 'arithmetic' cannot score 1 of 2 rows (None, e.g. row 1, prompt 'what?'); "
        "they count as wrong\n"
    )


def test_parse_ks():
    assert parse_ks("8, 1,2,2", 8) == [1, 2, 8]
    assert parse_ks(None, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert parse_ks(None, 5) == [1, 2, 4]


@pytest.fixture
def bad_files(tmp_path):
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"prompt": "what is two plus two?"}\n')
    return {"no_answer": str(no_answer), "dir": str(tmp_path)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--k", "1,x"], "--k: expected comma-separated positive integers"),
        (["--k", "0,2"], "--k: expected comma-separated positive integers"),
        (["--k", ""], "--k: expected comma-separated positive integers"),
        (["--n", "4", "--k", "1,8,16"], "--k: k = 8, 16 is more than --n 4 samples per prompt"),
        (["--model", "/no/such/model"], "--model: no such directory '/no/such/model'"),
        (["--data", "/no/such/data.jsonl"], "--data: no such file '/no/such/data.jsonl'"),
        (["--data", "arithmetic:0"], "--data: expected 'TASK:N' with N a positive integer"),
        (["--data", "tests.tasks.user_task:task:x"], "--data: expected 'TASK:N' with N a positive integer"),
        (
            ["--data", "algebra:3"],
            "--data: unknown task 'algebra' (built-ins: arithmetic, multiply, reasoning_gym; or give 'pkg.module:name')",
        ),
        (["--data", "tests.tasks.user_task:verify_only:3"], "--data: task 'avoid (verify only)' generates no rows"),
        (
            ["--data", "{no_answer}"],
            "task 'arithmetic' cannot score any row of --data (None for every one, e.g. row 0, "
            "prompt 'what is two plus two?'); does the data have the columns it reads? "
            "(columns: prompt)",
        ),
        (["--data", "{no_answer}", "--verifier", "exact_answer"], "needs an 'answer' column"),
        (["--task", "tests.tasks.user_task:task"], "task 'avoid' cannot score any row of --data"),
        (
            ["--task", "algebra"],
            "--task: unknown task 'algebra' (built-ins: arithmetic, multiply, reasoning_gym; or give 'pkg.module:name')",
        ),
        (
            ["--task", "tests.tasks.user_task:not_a_task"],
            "--task: task 'tests.tasks.user_task:not_a_task': 'not_a_task' is not a grpo.tasks.Task",
        ),
        (["--verifier", "tests.eval.no_such_module:fn"], "cannot import module 'tests.eval.no_such_module'"),
        (
            ["--answer", "tests.tasks.user_task:nope"],
            "--answer 'tests.tasks.user_task:nope': module 'tests.tasks.user_task' has no attribute 'nope'",
        ),
        (
            ["--answer", "tests.tasks.user_task:unhashable_answer"],
            "answer extractor 'tests.tasks.user_task:unhashable_answer' returned a list",
        ),
        (
            ["--answer", "tests.eval.test_command:explodes"],
            "answer extractor 'tests.eval.test_command:explodes' raised ValueError: cannot read this",
        ),
        (["--out", "{dir}"], "--out: "),
        (["--temperature", "0"], "--temperature: must be > 0"),
        (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    ],
)
def test_mistakes_are_one_line_before_the_model_loads(model_dir, bad_files, capsys, argv, message, monkeypatch):
    import grpo.infra.hf

    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not load when the arguments are wrong")

    monkeypatch.setattr(grpo.infra.hf, "load_causal_lm", no_loading)
    argv = [a.format(**bad_files) for a in argv]
    defaults = {"--model": model_dir, "--data": "arithmetic:3", "--n": "8"}
    for option, value in defaults.items():
        if option not in argv:
            argv = [option, value, *argv]
    code, stdout, err = run(capsys, *argv, "--quiet")
    assert code == 2
    assert stdout == ""
    assert err.count("\n") == 1 and err.startswith("grpo: error: ") and message in err


def test_help_explains_both_metrics(capsys):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["eval", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "pass@k" in text and "maj@k" in text and "--verifier" in text
    with pytest.raises(SystemExit):
        parser().parse_args(["eval", "--model", "m", "--data", "d", "--task", "arithmetic", "--verifier", "f"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_an_answer_pattern_reads_the_votes_and_missing_answers_are_said(tiny_model, tmp_path, capsys):
    """Without a way to read this model's answers, maj@k has no votes: a warning line says
    so. --answer-pattern reads them (the regex's last match); a bad pattern is one line."""
    common = [
        "--model",
        tiny_model,
        "--data",
        "tests.tasks.user_task:task:3",
        "--n",
        "6",
        "--max-new-tokens",
        "4",
        "--quiet",
        "--verifier",
        "tests.tasks.user_task:verify",
    ]
    code, _, err = run(capsys, *common, "--out", str(tmp_path / "none.json"))
    assert code == 0 and "warning: no final answer found in 100% of the samples" in err
    code, _, err = run(capsys, *common, "--answer-pattern", r"(\S)\S*$", "--out", str(tmp_path / "pattern.json"))
    results = json.loads((tmp_path / "pattern.json").read_text())
    assert code == 0 and "no final answer" not in err and results["no_answer"] < 0.5
    code, _, err = run(capsys, *common, "--answer-pattern", "([a-")
    assert code == 2 and err.strip().startswith("grpo: error: --answer-pattern: not a regular expression")


def test_eval_logged_to_a_file_writes_a_line_every_log_every_prompts(model_dir, capsys):
    """stderr not a terminal (captured, as `2> log` would): one readable line per --log-every
    prompts (the first and the last always), not a bar's carriage returns."""
    code, _, err = run(
        capsys,
        "--model",
        model_dir,
        "--data",
        "arithmetic:5",
        "--n",
        "2",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "4",
        "--log-every",
        "2",
    )
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("grpo eval: completions")]
    assert [line.split("  ")[1] for line in lines] == ["prompts 1/5", "prompts 2/5", "prompts 4/5", "prompts 5/5"]
    assert all(re.search(r"  pass@1 [01]\.\d{3}  elapsed \d+:\d\d  [\d.]+ completions/s$", line) for line in lines)
    assert "\r" not in err


def test_a_datasets_configuration_split_and_system_prompt(tmp_path, capsys, monkeypatch):
    """--data-config, --split and --system-prompt read the held-out rows as the eval section
    of a training config reads them (data.config, eval.split, data.system_prompt)."""
    from grpo.tasks.tiny import save_tiny_tool_model
    from tests.dataset_folders import gsm8k_rows, offline_datasets, write_gsm8k_folder

    offline_datasets(tmp_path, monkeypatch)
    folder = str(write_gsm8k_folder(tmp_path / "gsm8k"))
    model = str(save_tiny_tool_model(tmp_path / "model", hidden_size=32, layers=1, heads=2))
    out = tmp_path / "results.json"
    common = ["--model", model, "--data", folder, "--prompt-column", "question", "--n", "1", "--max-new-tokens", "2"]
    common += ["--verifier", "tests.eval.test_command:seven_tenths", "--quiet"]
    code, _, err = run(capsys, *common, "--data-config", "socratic", "--system-prompt", "Be brief.", "--out", str(out))
    assert code == 0, err
    prompts = [p["prompt"] for p in json.loads(out.read_text())["per_prompt"]]
    system = {"role": "system", "content": "Be brief."}
    assert prompts == [[system, {"role": "user", "content": r["question"]}] for r in gsm8k_rows("socratic", "test")]
    code, _, err = run(capsys, *common, "--data-config", "main", "--split", "train", "--out", str(out))
    assert code == 0, err
    assert [p["prompt"] for p in json.loads(out.read_text())["per_prompt"]] == [
        r["question"] for r in gsm8k_rows("main", "train")
    ]
    code, _, err = run(capsys, *common, "--data-config", "nope")
    assert code == 2 and err.startswith("grpo: error: --data-config:") and "socratic" in err, err
