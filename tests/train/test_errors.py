"""Bad input exits non-zero with one clear line and no traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.cli import main


def write(tmp_path, config, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_cli(capsys, *argv):
    code = main(["train", *argv, "--quiet"])
    err = capsys.readouterr().err.strip()
    return code, err


def change(config, dotted, value):
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return config


CASES = [
    ("data.path", "/no/such/prompts.jsonl", "data.path: no such file"),
    ("rollout.group_size", 1, "rollout.group_size: the group baseline needs at least 2"),
    ("data.prompt_column", "question", "data.prompt_column: no column 'question'"),
    ("rewards.0.function", "exact_anwser", "unknown reward 'exact_anwser'; did you mean 'exact_answer'?"),
    ("rewards.0.function", "tests.train.no_such_module:fn", "cannot import module 'tests.train.no_such_module'"),
    (
        "rewards.0.function",
        "tests.train.rewards_for_tests:explodes",
        "raised ZeroDivisionError: the reward divided by zero on row 0",
    ),
    ("model", "/no/such/model", "model: no such directory '/no/such/model'"),
    ("rollout.sampler", "sglang", "rollout.sampler: expected one of"),
    ("train.autocast", "float16", "train.autocast: expected one of"),
]


@pytest.mark.parametrize(("key", "value", "message"), CASES, ids=[c[2][:30] for c in CASES])
def test_bad_input_is_one_line(capsys, make_config, tmp_path, key, value, message):
    code, err = run_cli(capsys, write(tmp_path, change(make_config(), key, value)))
    assert code == 2
    assert message in err
    assert err.startswith("grpo: error: ") and "\n" not in err and "Traceback" not in err


def test_misspelt_key_is_named_with_a_suggestion(capsys, make_config, tmp_path):
    config = make_config()
    config["rollout"]["gropu_size"] = config["rollout"].pop("group_size")
    code, err = run_cli(capsys, write(tmp_path, config))
    assert code == 2
    assert err == "grpo: error: unknown config key 'rollout.gropu_size' (did you mean 'rollout.group_size'?)"


def test_overrides_are_validated_too(capsys, make_config, tmp_path):
    code, err = run_cli(capsys, write(tmp_path, make_config()), "--set", "train.lr=fast")
    assert code == 2 and err == "grpo: error: train.lr: expected float, got 'fast'"


def test_missing_config_file(capsys, tmp_path):
    code, err = run_cli(capsys, str(tmp_path / "nope.yaml"))
    assert code == 2 and "config file not found" in err


def test_a_finished_run_is_not_overwritten_unless_asked(capsys, make_config, tmp_path):
    config = write(tmp_path, make_config(train={"steps": 1}))
    assert main(["train", config, "--quiet"]) == 0
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    capsys.readouterr()
    code, err = run_cli(capsys, config)
    assert code == 2 and "already holds a run; pass --resume to continue it, --overwrite to start afresh" in err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # nothing lost
    (tmp_path / "run" / "notes.txt").write_text("mine")
    code, err = run_cli(capsys, config, "--overwrite")
    assert code == 0
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # only the run's own files go
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_in_a_folder_with_no_completed_step_starts_afresh(capsys, make_config, tmp_path):
    fresh = write(tmp_path, make_config(output_dir=str(tmp_path / "empty"), train={"steps": 2}), "fresh.yaml")
    code, err = run_cli(capsys, fresh, "--resume")
    assert code == 0, err
    assert len((tmp_path / "empty" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_the_process_prints_no_traceback(make_config, tmp_path):
    config = write(tmp_path, change(make_config(), "data.path", str(tmp_path / "missing.jsonl")))
    grpo = str(Path(sys.executable).parent / "grpo")
    done = subprocess.run([grpo, "train", config], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"grpo: error: data.path: no such file '{tmp_path / 'missing.jsonl'}'"]


def test_fast_sampler_with_lora_is_refused_before_loading(capsys, make_config, tmp_path):
    config = make_config(rollout={"sampler": "fast"}, lora={"r": 2}, model="/no/such/model")
    code, err = run_cli(capsys, write(tmp_path, config))
    assert code == 2 and "rollout.sampler: fast cannot decode a LoRA-wrapped policy" in err  # not the missing model
