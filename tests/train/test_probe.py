"""`grpo probe` (grpo.train.probe): step 1's batch, its numbers equal to the first training
step's, and a verdict that tells an untrained base from one warmed up with `grpo sft`."""

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from grpo.cli import main
from grpo.train.probe import histogram, pass_rates, probe, verdict
from grpo.train.sft import FineTuneConfig, sft
from tests.helpers import assert_same_metrics

PROMPTS = ["a", "b", "c", "ab", "ba", "cab", "abc", "cc"]


def seventy_seven(completions, **columns):
    """The task: answer exactly "77"."""
    return [float(c == "77") for c in completions]


def write_config(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_every_number_printed_is_the_first_training_step_s(make_config, tmp_path, capsys):
    """`grpo probe --json` and a one-step `grpo train` of the same config and seed: the JSON's
    numbers are metrics.jsonl's step 1, and the probe left output_dir alone. Two rewards, one
    of which cannot score some completions, and completions that end at different lengths."""
    config = make_config(
        rewards=[
            {"function": "tests.train.rewards_for_tests:sevens"},
            {"function": "tests.train.rewards_for_tests:sevens_or_none", "weight": 0.5},
        ],
        rollout={"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 0},
        train={"steps": 1, "sample_every": 0},
        seed=3,
    )
    path = write_config(tmp_path / "run.yaml", config)
    assert main(["probe", path, "--json", str(tmp_path / "probe.json")]) == 0
    printed = capsys.readouterr().out
    assert not Path(config["output_dir"]).exists()
    numbers = json.loads((tmp_path / "probe.json").read_text())
    assert numbers["first_step"] and numbers["verdict"] in printed.splitlines()[-1]
    assert main(["train", path, "--quiet"]) == 0
    (step,) = [json.loads(line) for line in (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    keys = [
        "reward/mean",
        "reward/std",
        "reward/tests.train.rewards_for_tests:sevens",
        "reward/tests.train.rewards_for_tests:sevens_or_none",
        "frac_zero_std_groups",
        "frac_unscored",
        "frac_truncated",
        "completion_length/mean",
        "tokens/completion",
    ]
    assert_same_metrics(numbers, step, keys)
    assert 0 < step["frac_truncated"] < 1 and 0 < step["frac_zero_std_groups"] < 1  # the numbers say something
    assert f"{step['frac_truncated']:.0%}" in printed and f"{step['completion_length/mean']:.1f}" in printed


@pytest.fixture(scope="module")
def warmed_up(tiny_model, tmp_path_factory):
    """The tiny base after `grpo sft` on the task's answer format (two digits, then the end):
    half its rows answer "77", half "78", so that it hits the reward about half the time."""
    folder = tmp_path_factory.mktemp("warm")
    rng = random.Random(0)
    rows = [{"prompt": p, "completion": "7" + rng.choice("78")} for p in PROMPTS for _ in range(8)]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = FineTuneConfig(
        model=tiny_model, data=str(folder / "rows.jsonl"), steps=16, batch_size=16, lr=1e-2, warmup_steps=1
    )
    sft(folder / "model", config, progress=False, device="cpu")
    return str(folder / "model")


def test_an_untrained_base_is_told_to_warm_up_and_a_warmed_up_one_to_go(tiny_model, warmed_up, tmp_path):
    (tmp_path / "task.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    config = {
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(tmp_path / "task.jsonl")},
        "rewards": [{"function": "tests.train.test_probe:seventy_seven"}],
        "rollout": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 4},
        "train": {"steps": 1, "device": "cpu"},
    }
    base = probe({**config, "model": tiny_model})
    assert base["verdict"] == "warm up", base
    assert base["groups_teaching"] < 0.1 and base["reward/mean"] < 0.05
    few = probe({**config, "model": tiny_model}, prompts=2)  # not the first step's batch any more
    assert len(few["pass_rates"]) == few["prompts"] == 2 and not few["first_step"] and base["first_step"]
    warm = probe({**config, "model": warmed_up})
    assert warm["verdict"] == "go", warm
    assert warm["groups_teaching"] >= 0.5 and warm["frac_truncated"] < 0.5


def numbers(teaching=0.0, cut=0.0, rates=(0.0,) * 4, unscored=0.0, std=0.1, group_size=8):
    """A probe's numbers as `verdict` reads them."""
    return {
        "groups_teaching": teaching,
        "frac_truncated": cut,
        "pass_rates": list(rates),
        "frac_unscored": unscored,
        "reward/std": std,
        "group_size": group_size,
        "max_new_tokens": 64,
        "threshold": 0.5,
    }


@pytest.mark.parametrize(
    "given,want",
    [
        (numbers(unscored=1.0, teaching=0.0), "fix the rewards"),
        (numbers(teaching=0.75, rates=(0.25, 0.5, 0.75, 1.0)), "go"),
        (numbers(teaching=0.5, cut=0.6, rates=(0.25, 0.5, 0.0, 0.0)), "raise the budget"),
        (numbers(teaching=0.25, rates=(1.0, 1.0, 1.0, 0.5)), "make it harder"),
        (numbers(teaching=0.0, cut=0.95), "raise the budget"),
        (numbers(teaching=0.25, cut=0.6, rates=(0.5, 0.0, 0.0, 0.0)), "raise G"),
        (numbers(teaching=0.05, cut=0.6), "warm up"),
        (numbers(teaching=0.0), "warm up"),
        # G = 1 (PPO): any spread over the batch teaches the critic's baseline.
        (numbers(teaching=None, std=0.3, rates=(1.0, 0.0, 0.0, 1.0), group_size=1), "go"),
        (numbers(teaching=None, std=0.0, group_size=1), "warm up"),
    ],
)
def test_the_verdict_names_the_change_to_make_first(given, want):
    said, advice = verdict(given)
    assert said == want, advice
    assert advice and "\n" not in advice


def test_pass_rates_count_an_unscored_sample_as_a_failure_and_the_histogram_bins_them():
    scores = torch.tensor([1.0, 0.5, 0.2, float("nan"), 0.0, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6, 0.5, 0.1, 0.1, 0.1])
    rates = pass_rates(scores, 4, 0.5)
    assert rates == [0.5, 0.0, 1.0, 0.25]
    assert histogram(rates) == {
        "0": 0.25,
        "(0,1/4]": 0.25,
        "(1/4,1/2]": 0.25,
        "(1/2,3/4]": 0.0,
        "(3/4,1)": 0.0,
        "1": 0.25,
    }
    assert sum(histogram([i / 8 for i in range(9)]).values()) == pytest.approx(1.0)  # every rate in one bin


@pytest.mark.parametrize(
    "arguments,words",
    [
        (["--threshold", "nan"], "--threshold: must be a finite number"),
        (["--json", "/no/such/folder/probe.json"], "--json: cannot write"),
        (["--set", "rollout.group_size=0"], "rollout.group_size"),
    ],
)
def test_bad_input_is_one_line(make_config, tmp_path, capsys, arguments, words):
    path = write_config(tmp_path / "run.yaml", make_config())
    assert main(["probe", path, *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("grpo: error: ") and words in err and "\n" not in err, err


def test_help_and_a_missing_config(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["probe", "--help"])
    assert stop.value.code == 0
    assert "frac_zero_std_groups" in capsys.readouterr().out
    assert main(["probe", "/no/such.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "grpo: error: config file not found: /no/such.yaml"
    with pytest.raises(SystemExit):
        main(["probe", "/no/such.yaml", "--prompts", "0"])  # argparse refuses it, in one line
    assert "--prompts" in capsys.readouterr().err
