"""TRL's reward-function loggers, `log_metric(name, value)` and `log_extra(column, values)`:
what a function logs reaches the step's metrics and samples.jsonl (row-aligned), from a
function called on its thread, in a worker process (isolate) or on the async loop; each
mistake is one UserError line that names the function."""

import json
from pathlib import Path

import pytest

import grpo
from grpo.errors import UserError
from grpo.rewards import load_rewards, score
from grpo.rewards.logged import RewardLog, merge_metrics

SPEC = "tests.rewards.trl_style_rewards:{}"
PLACES = [{}, {"timeout": 5.0}, {"isolate": True}]


def rewards(*names, **option):
    return load_rewards([(SPEC.format(n), 1.0) for n in names], [dict(option) for _ in names])


@pytest.mark.parametrize("place", PLACES, ids=["here", "on_a_thread", "isolated"])
def test_trls_example_logs_its_columns_and_metric(place):
    completions = ["\\boxed{7}", "no box", "\\boxed{3}", "\\boxed{4}"]
    log = RewardLog(4)
    result = score(rewards("boxed_accuracy", **place), ["q"] * 4, completions, {"ground_truth": list("7734")}, log=log)
    assert list(result.per_function.values())[0].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert log.metrics == {"accuracy": [0.75]}
    assert log.columns == {"golden_answer": list("7734"), "extracted_answer": ["7", "[none]", "3", "4"]}


def test_without_a_log_the_loggers_are_not_given():
    """grpo eval (and iterative RL's verifier) score without a log: TRL's example, whose
    loggers default to None, scores as in training."""
    result = score(rewards("boxed_accuracy"), ["q"], ["\\boxed{1}"], {"ground_truth": ["1"]})
    assert list(result.per_function.values())[0].tolist() == [1.0]


def test_async_functions_on_one_loop_log_each_their_own():
    log = RewardLog(3)
    score(rewards("async_logged", "async_logged_too"), ["q"] * 3, ["a", "bb", "ccc"], {}, log=log)
    assert sorted(log.metrics["async_calls"]) == [1.0, 3.0]
    assert log.columns == {"async_length": [1, 2, 3]}
    assert merge_metrics([log.metrics, {"async_calls": [5.0], "other": [2.0]}]) == {"async_calls": 3.0, "other": 2.0}


def test_the_columns_follow_the_rows_kept():
    log = RewardLog(4)
    score(rewards("sevens_logged"), ["q"] * 4, ["7", "77x", "", "a7"], {}, log=log)
    kept = log.select([3, 1])
    assert kept.columns == {"sevens": [1, 2], "chars": [2, 3]} and kept.metrics == {"with_a_seven": [0.75]}


def test_a_metric_may_be_a_one_element_tensor():
    log = RewardLog(2)
    score(rewards("logs_a_tensor"), ["q"] * 2, ["ab", "abcd"], {}, log=log)
    assert log.metrics == {"mean_length": [3.0]}


MISTAKES = {
    "not a number": r"called log_metric\('score', 'high'\); expected log_metric\(name, value\)",
    "infinite": r"called log_metric\('score', inf\); expected",
    "no name": r"called log_metric\(7, 1.0\); expected",
    "no value": r"called log_metric\('score'\); expected",
    "a tensor for a name": r"called log_metric\(tensor\(\[1., 2.\]\)\); expected",
    "short column": r"called log_extra\('score', \.\.\.\) with 1 values for 2 completions; give one per completion",
    "our column": r"called log_extra\('reward', \.\.\.\): samples.jsonl writes 'reward' itself",
    "not json": r"called log_extra\('score', \.\.\.\) with values samples.jsonl cannot write",
    "not a list": r"called log_extra\('score', 'abc'\); expected log_extra\(column, values\)",
}


@pytest.mark.parametrize("place", PLACES, ids=["here", "on_a_thread", "isolated"])
@pytest.mark.parametrize("how", sorted(MISTAKES))
def test_a_mistake_with_the_loggers_is_one_line_naming_the_function(how, place):
    name = SPEC.format("logs_badly")
    with pytest.raises(UserError, match=rf"^reward {name!r} {MISTAKES[how]}") as raised:
        score(rewards("logs_badly", **place), ["q"] * 2, ["a", "b"], {"how": [how] * 2}, log=RewardLog(2))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("isolate", [False, True], ids=["here", "isolated"])
def test_a_run_writes_what_the_rewards_log(make_config, isolate):
    """Each metrics.jsonl line has the logged metric; each samples.jsonl line the logged
    columns of its own completion (the count of its '7's, its length)."""
    config = make_config(rewards=[{"function": SPEC.format("sevens_logged"), "isolate": isolate}])
    result = grpo.train(config, progress=False)
    name = f"reward/{SPEC.format('sevens_logged')}"
    for m in result.metrics:
        assert 0.0 <= m["with_a_seven"] <= 1.0
        assert (m["with_a_seven"] > 0) == (m[name] > 0)
    lines = (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["with_a_seven"] for line in lines] == [m["with_a_seven"] for m in result.metrics]
    samples = [json.loads(line) for line in (Path(config["output_dir"]) / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 16  # steps 2 and 4, G = 8
    assert any(s["sevens"] for s in samples) and len({s["chars"] for s in samples}) > 1
    for s in samples:
        assert s["sevens"] == s["completion"].count("7") == s["reward"]
        assert s["chars"] == len(s["completion"])


def test_a_metric_named_as_one_of_the_steps_is_refused(make_config, tmp_path):
    data = tmp_path / "how.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "how": "our metric"}) + "\n" for p in "abcd"))
    config = make_config(data={"path": str(data)}, rewards=[{"function": SPEC.format("logs_badly")}])
    with pytest.raises(UserError, match=r"^a reward function called log_metric\('reward/mean', \.\.\.\): the step's"):
        grpo.train(config, progress=False)
