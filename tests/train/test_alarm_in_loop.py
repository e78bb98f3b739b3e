"""The reward-hacking alarm in a run: a planted reward that pays length raises it, an honest one does not.

The task: answer in at most 2 characters (`short`, the held-out verifier). The tiny base
model stops that early in about a fifth of its samples. A reward that pays every character
(`length`) teaches it never to stop: the training reward climbs while the held-out pass@1
collapses towards 0 within a few steps. Paid by the verifier itself, the same run drives
pass@1 towards 1. The effect is far larger than the evaluations' intervals, so which way the
alarm goes does not hang on a float's last bits (another CPU's kernels, another trajectory).
"""

import json
from pathlib import Path

import pytest

import grpo
from grpo.errors import Stopped
from grpo.infra.checkpoint import list_checkpoints

pytestmark = pytest.mark.learning

HELD_OUT = ["a", "b", "c", "ab", "ba", "cab", "abc", "cc", "1", "22", "a1", "b2c", "3", "c4", "bb", "0a"]
SPEC = "tests.train.test_alarm_in_loop"
WARNING = "possible reward hacking"


def length(completions, **columns):
    """The planted, hackable reward: every character pays."""
    return [float(len(c)) for c in completions]


def short(completions, **columns):
    """The task's verifier: an answer of at most 2 characters."""
    return [float(len(c) <= 2) for c in completions]


@pytest.fixture
def alarm_config(make_config, tmp_path):
    """A run paid by `reward`, evaluated every 5 steps on held-out prompts by `short`."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in HELD_OUT))

    def make(reward, **sections):
        config = make_config(
            rewards=[{"function": f"{SPEC}:{reward}"}],
            rollout={"max_new_tokens": 8, "min_new_tokens": 0, "temperature": 1.0},
            train={"steps": 20, "lr": 1e-3, "sample_every": 0, "keep_best": "eval/pass@1"},
            loss={"beta": 0.0},
            eval={
                "data": str(held_out),
                "verifier": f"{SPEC}:short",
                "every": 5,
                "n": 8,
                "k": [1],
                "temperature": 1.0,
                "alarm_window": 3,
            },
        )
        for section, values in sections.items():
            if isinstance(values, dict):
                config[section].update(values)
            else:
                config[section] = values
        return config

    return make


def evaluations(output_dir) -> list[dict]:
    """The rows of metrics.jsonl that hold an evaluation."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "eval/pass@1" in row]


def alarm_columns(rows) -> list[tuple]:
    """What the alarm saw and said at each evaluation."""
    return [(r["step"], r.get("reward/mean"), r["eval/pass@1"], r["alarm/reward_hacking"]) for r in rows]


def test_a_reward_that_pays_length_raises_the_alarm(alarm_config, capsys, tmp_path):
    result = grpo.train(alarm_config("length", output_dir=str(tmp_path / "whole")), progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if WARNING in line]
    rows = evaluations(result.output_dir)
    assert warnings, [(r["step"], r["eval/pass@1"], r.get("reward/mean")) for r in rows]
    assert warnings[0].startswith("grpo: warning: step ") and "eval/pass@1 fell" in warnings[0]
    raised = [r for r in rows if r["alarm/reward_hacking"] == 1.0]
    assert raised and warnings[0].startswith(f"grpo: warning: step {raised[0]['step']}:")
    assert rows[-1]["eval/pass@1"] < rows[0]["eval/pass@1"]  # the task did get worse

    # eval.stop_when_diverging: the same run stops where the alarm rises, with a checkpoint
    # there and best/ the best evaluated policy; one line says so.
    config = alarm_config("length", output_dir=str(tmp_path / "stopped"), eval={"stop_when_diverging": True})
    with pytest.raises(Stopped) as stopped:
        grpo.train(config, progress=False)
    out, at = Path(config["output_dir"]), raised[0]["step"]
    message = str(stopped.value)
    assert "\n" not in message
    for said in (f"after step {at}", "reward-hacking alarm", "best/", "--resume"):
        assert said in message, (said, message)
    assert [r["step"] for r in evaluations(out)][-1] == at
    assert list_checkpoints(out)[-1].name.endswith(str(at))
    best = json.loads((out / "best" / "best.json").read_text())
    top = max(rows[: rows.index(raised[0]) + 1], key=lambda r: r["eval/pass@1"])
    assert (best["step"], best["value"]) == (top["step"], top["eval/pass@1"])
    # --resume goes on past it, the alarm's window and reward record restored with the
    # checkpoint: its evaluations are those of the run never stopped.
    config["eval"]["stop_when_diverging"] = False
    grpo.train(config, progress=False, resume=True)
    assert alarm_columns(evaluations(out)) == alarm_columns(rows)


def test_an_honest_run_keeps_the_alarm_quiet(alarm_config, capsys):
    result = grpo.train(alarm_config("short"), progress=False)
    assert WARNING not in capsys.readouterr().err
    rows = evaluations(result.output_dir)
    assert [r["alarm/reward_hacking"] for r in rows] == [0.0] * len(rows)
    assert rows[-1]["eval/pass@1_lo"] > rows[0]["eval/pass@1"]  # it learnt the task: the rise is real
