"""Evaluation in the loop under torchrun (gloo, 2 processes on the CPU): the processes share the
held-out problems out, and the numbers each step logs are those one process gives (`grpo eval`
on the same weights), best/ included. A file of its own so that pytest-xdist's workers share it."""

import dataclasses
import json
from pathlib import Path

import pytest

from tests.train.test_distributed import torchrun, write_config
from tests.train.test_in_loop_evaluation import (
    EVAL,
    assert_same_as_grpo_eval,
    config_of,
    eval_options,
    grpo_eval,
    lines,
)

pytestmark = pytest.mark.torchrun


def test_two_processes_report_the_one_process_numbers(tiny_model, prompts_file, tmp_path):
    # 5 problems of 4 samples, 8 samples a call: calls of 2, 2 and 1 problems, process 0
    # sampling the first and the last, process 1 the second.
    held_out = {"data": prompts_file, **EVAL, "every": 1, "prompts": 5, "batch_size": 8}
    config = config_of(
        tiny_model, prompts_file, tmp_path / "run", steps=2, eval=held_out, train={"keep_best": "eval/pass@1"}
    )
    run = torchrun("-m", "grpo", "train", str(write_config(tmp_path, "two", config)), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "run"
    logged = [m for m in lines(out) if "eval/pass@1" in m]
    assert [m["step"] for m in logged] == [0, 1, 2]

    five = tmp_path / "five.jsonl"  # the problems eval.prompts takes
    five.write_text("".join(Path(prompts_file).read_text().splitlines(keepends=True)[:5]))
    options = dataclasses.replace(eval_options(str(five), tiny_model), batch_size=8)
    for line, model in ((logged[0], tiny_model), (logged[-1], str(out / "final"))):
        assert_same_as_grpo_eval(line, grpo_eval(dataclasses.replace(options, model=model), tmp_path))
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] == max(m["eval/pass@1"] for m in logged)
    again = grpo_eval(dataclasses.replace(options, model=str(out / "best")), tmp_path)
    assert again["pass@k"]["1"] == best["value"]  # best/ is the policy evaluated at that step, whole
