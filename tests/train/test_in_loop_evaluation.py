"""Evaluation in the loop (the eval section, train.keep_best): the numbers are `grpo eval`'s on
the same weights and seed, evaluating leaves training's numbers as they were, best/ is the best
evaluated policy and stays so across a kill and --resume, and mistakes in the section are one
line before any model loads. Under torchrun: tests/train/test_distributed_evaluation.py."""

import copy
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.eval.command import EvalConfig, run
from grpo.tasks import load_task
from grpo.train.evaluation import held_out
from grpo.train.loop import _progress_fields, train
from tests.train.test_resume import DETERMINISTIC, grpo_train

SEVENS = "tests.train.rewards_for_tests:sevens"
# What the evaluation measures, and the `grpo eval` options that measure the same.
EVAL = {"n": 4, "k": [1, 2, 4], "every": 2, "batch_size": 6, "threshold": 0.125, "seed": 3, "answer_pattern": "7+"}


def eval_options(data, model):
    """`grpo eval`'s options for EVAL (the verifier: the run's reward, named)."""
    return EvalConfig(
        model=model,
        data=data,
        n=EVAL["n"],
        k="1,2,4",
        verifier=SEVENS,
        threshold=EVAL["threshold"],
        answer_pattern=EVAL["answer_pattern"],
        max_new_tokens=8,  # rollout.max_new_tokens: eval.max_new_tokens is 0
        batch_size=EVAL["batch_size"],
        seed=EVAL["seed"],
    )


def grpo_eval(options, tmp_path):
    out = tmp_path / "eval.json"
    assert run(options, load_task=load_task, out=str(out), progress=False) == 0
    return json.loads(out.read_text())


def config_of(tiny_model, prompts_file, output_dir, *, steps=4, **sections):
    config = {
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(output_dir),
        "data": {"path": prompts_file},
        "rewards": [{"function": SEVENS}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": steps, "lr": 1e-2, "sample_every": 0},
        "loss": {"beta": 0.04},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def lines(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def evaluated(output_dir, metric="eval/pass@1"):
    """{step: value} of the evaluations in a run's metrics.jsonl."""
    return {m["step"]: m[metric] for m in lines(output_dir) if metric in m}


def assert_same_as_grpo_eval(line, report):
    """The eval metrics of a line of metrics.jsonl equal those of a `grpo eval` report."""
    for name in ("pass@", "maj@"):
        for k, value in report[f"{name}k"].items():
            lo, hi = report[f"{name}k_ci"][k]
            assert (line[f"eval/{name}{k}"], line[f"eval/{name}{k}_lo"], line[f"eval/{name}{k}_hi"]) == (value, lo, hi)
    assert line["eval/truncated"] == report["truncated"] and line["eval/no_answer"] == report["no_answer"]


@pytest.fixture(scope="module")
def runs(tiny_model, prompts_file, tmp_path_factory):
    """4 steps evaluated at 0, 2 and 4 (best/ kept by pass@1), and the same run without an eval
    section. Two minibatches a step: the update draws its order from the global random stream,
    which an evaluation must leave where it found it."""
    tmp = tmp_path_factory.mktemp("in-loop")
    with_eval = config_of(
        tiny_model,
        prompts_file,
        tmp / "evaluated",
        eval={"data": prompts_file, **EVAL},
        train={"keep_best": "eval/pass@1", "minibatches": 2},
    )
    train(with_eval, progress=False)
    train(config_of(tiny_model, prompts_file, tmp / "plain", train={"minibatches": 2}), progress=False)
    return tmp


def test_the_in_loop_numbers_are_grpo_eval_s_on_the_same_weights(runs, tiny_model, prompts_file, tmp_path):
    out = runs / "evaluated"
    logged = [m for m in lines(out) if "eval/pass@1" in m]
    assert [m["step"] for m in logged] == [0, 2, 4]  # step 0, every 2, the last
    assert lines(out)[0].keys() == {"step", *logged[0]} - {"reward/mean"}  # step 0's line: the evaluation alone
    first = grpo_eval(eval_options(prompts_file, tiny_model), tmp_path)
    last = grpo_eval(eval_options(prompts_file, str(out / "final")), tmp_path)
    assert_same_as_grpo_eval(logged[0], first)
    assert_same_as_grpo_eval(logged[-1], last)
    assert first["pass@k"] != last["pass@k"]  # training moved them: the two comparisons are not one
    assert 0 < first["maj@k"]["4"] < 1 and first["no_answer"] < 1  # votes were read (eval.answer_pattern)


def test_evaluating_changes_no_number_of_the_training(runs):
    trained = [m for m in lines(runs / "evaluated") if m["step"] > 0]
    assert [{k: m[k] for k in DETERMINISTIC} for m in trained] == [
        {k: m[k] for k in DETERMINISTIC} for m in lines(runs / "plain")
    ]


def test_best_is_the_best_evaluated_policy(runs, prompts_file, tmp_path):
    out = runs / "evaluated"
    values = evaluated(out)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] == max(values.values()) and values[best["step"]] == best["value"]
    assert best["step"] == min(s for s, v in values.items() if v == best["value"])  # the first to reach it
    again = grpo_eval(eval_options(prompts_file, str(out / "best")), tmp_path)  # a plain model directory
    assert again["pass@k"]["1"] == best["value"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4  # step 0's evaluation is no step


def test_the_progress_line_shows_the_latest_pass_at_1():
    step = {"reward/mean": 0.5, "kl": 0.01, "completion_length/mean": 7.0}
    assert "pass@1" not in _progress_fields(step)
    assert _progress_fields({**step, "eval/pass@1": 0.25})["pass@1"] == "0.250"


# ---- mistakes: one line, before any model loads ------------------------------------------------


def check(tiny_model, prompts_file, tmp_path, **sections):
    return held_out(config_from_dict(config_of(tiny_model, prompts_file, tmp_path / "run", **sections)))


def test_mistakes_in_the_eval_section_are_one_line(tiny_model, prompts_file, tmp_path):
    with pytest.raises(UserError, match=r"^eval\.data: .*nope\.jsonl"):
        check(tiny_model, prompts_file, tmp_path, eval={"data": str(tmp_path / "nope.jsonl")})
    with pytest.raises(UserError, match=r"^train\.keep_best: eval/pass@8 is not measured: eval\.k is 1, 2, 4"):
        check(
            tiny_model,
            prompts_file,
            tmp_path,
            eval={"data": prompts_file, "n": 8, "k": [1, 2, 4]},
            train={"keep_best": "eval/pass@8"},
        )
    with pytest.raises(UserError, match=r"^eval\.task: unknown task 'no_such_task'"):
        check(tiny_model, prompts_file, tmp_path, eval={"data": prompts_file, "task": "no_such_task"})
    with pytest.raises(UserError, match=r"cannot score any row of eval\.data"):  # the arithmetic task reads 'answer'
        check(tiny_model, prompts_file, tmp_path, eval={"data": prompts_file, "task": "arithmetic"})
    with pytest.raises(UserError, match=r"^eval\.prompt_column: .*'question'"):
        check(tiny_model, prompts_file, tmp_path, eval={"data": prompts_file, "prompt_column": "question"})
    # Found before the model (which does not exist here) is looked at.
    config = config_of(str(tmp_path / "no-model"), prompts_file, tmp_path / "run", eval={"data": "nope.jsonl"})
    with pytest.raises(UserError, match=r"^eval\.data:"):
        train(config, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_datasets_configuration_and_split_are_named_as_eval_keys(tiny_model, prompts_file, tmp_path, monkeypatch):
    """eval.config and eval.split read a dataset folder as grpo eval's --data-config and
    --split do; their mistakes name the eval keys."""
    from tests.dataset_folders import gsm8k_rows, offline_datasets, write_gsm8k_folder

    offline_datasets(tmp_path, monkeypatch)
    folder = str(write_gsm8k_folder(tmp_path / "gsm8k"))
    section = {"data": folder, "prompt_column": "question", "verifier": SEVENS}
    config = config_from_dict(
        config_of(tiny_model, prompts_file, tmp_path / "run", eval={**section, "config": "socratic"})
    )
    assert [row["question"] for row in held_out(config).rows] == [r["question"] for r in gsm8k_rows("socratic", "test")]
    with pytest.raises(UserError, match=r"^eval\.config: .*socratic"):
        check(tiny_model, prompts_file, tmp_path, eval={**section, "config": "nope"})
    with pytest.raises(UserError, match=r"^eval\.split: "):
        check(tiny_model, prompts_file, tmp_path, eval={**section, "config": "main", "split": "validation"})


def test_the_held_out_rows_and_verifier_default_as_grpo_eval_s(tiny_model, prompts_file, tmp_path):
    held = check(tiny_model, prompts_file, tmp_path, eval={"data": "arithmetic:5", "prompts": 3, "n": 8})
    assert [r["prompt"] for r in held.rows] == [
        r["prompt"] for r in load_task("arithmetic").make_rows(5, seed=20240205)
    ][:3]
    assert held.ks == [1, 2, 4, 8] and held.options["max_new_tokens"] == 8  # rollout.max_new_tokens
    row = held.rows[0]
    assert held.verifier.check_all([row["solution"], "nonsense"], row) == [True, False]  # the task's verifier
    held = check(tiny_model, prompts_file, tmp_path, eval={"data": prompts_file})  # the run's reward, threshold 0.5
    assert held.verifier.check_all(["7777", "7", ""], held.rows[0]) == [True, False, False]


# ---- train.keep_best across a kill and --resume ------------------------------------------------


def weights(directory):
    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def forget_best(output_dir):
    """The newest checkpoint as one that knows of no best evaluation (its manifest kept valid):
    a checkpoint older than best/, whose every evaluation the resumed run would take for the best."""
    from grpo.infra.checkpoint import MANIFEST, _sha256, list_checkpoints

    path = list_checkpoints(output_dir)[-1]
    state = torch.load(path / "state.pt", weights_only=True)
    state["evaluation"]["best"] = None
    torch.save(state, path / "state.pt")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"]["state.pt"] = _sha256(path / "state.pt")
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.resume
def test_best_survives_a_kill_and_resume(tiny_model, prompts_file, tmp_path):
    """6 steps evaluated at each, checkpoints at 3; killed inside step 5 (best/ may then be newer
    than the checkpoint). The resumed run logs the straight run's numbers and keeps its best/.
    And a best/ better than the checkpoint knows is left as it is: a resumed run that does not
    repeat itself exactly (another host, another seed) must not replace it with a worse policy."""
    config = config_of(
        tiny_model,
        prompts_file,
        tmp_path / "straight",
        steps=6,
        eval={"data": prompts_file, **EVAL, "every": 1, "verifier": SEVENS},  # not the dying reward: its calls count
        train={"keep_best": "eval/pass@1", "checkpoint_every": 3},
    )
    config["rewards"] = [{"function": "tests.train.rewards_for_tests:sevens_then_die"}]
    train(config, progress=False)
    killed = {**config, "output_dir": str(tmp_path / "killed")}
    path = tmp_path / "killed.yaml"
    path.write_text(json.dumps(killed))
    run_ = grpo_train(path, env={"GRPO_TEST_DIE_AT": "5"})
    assert run_.returncode == -signal.SIGKILL, run_.stderr[-2000:]
    assert max(evaluated(tmp_path / "killed")) == 4  # evaluated up to step 4, checkpoint of step 3
    shutil.copytree(tmp_path / "killed", tmp_path / "better")

    train(killed, resume=True, progress=False)
    keys = [*DETERMINISTIC, "eval/pass@1", "eval/maj@4", "eval/pass@4_lo"]
    straight, resumed = lines(tmp_path / "straight"), lines(tmp_path / "killed")
    assert [{k: m.get(k) for k in keys} for m in resumed] == [{k: m.get(k) for k in keys} for m in straight]
    record = (tmp_path / "killed" / "best" / "best.json").read_text()
    assert record == (tmp_path / "straight" / "best" / "best.json").read_text()
    for name, tensor in weights(tmp_path / "straight" / "best").items():
        assert torch.equal(weights(tmp_path / "killed" / "best")[name], tensor), name

    better = tmp_path / "better"
    forget_best(better)
    record = better / "best" / "best.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "value": 1.0}))  # beyond any evaluation
    kept = weights(better / "best")
    train({**killed, "output_dir": str(better)}, resume=True, progress=False)
    assert json.loads(record.read_text())["value"] == 1.0
    now = weights(better / "best")
    assert all(torch.equal(now[name], tensor) for name, tensor in kept.items())


# ---- LoRA: saving best/ leaves the adapters training -------------------------------------------


def test_a_lora_run_keeps_best_without_touching_its_adapters(tiny_model, prompts_file, tmp_path):
    lora = {"r": 8, "alpha": 32}
    kept = config_of(
        tiny_model,
        prompts_file,
        tmp_path / "kept",
        steps=2,
        lora=lora,
        eval={"data": prompts_file, **EVAL, "every": 1, "prompts": 4},
        train={"keep_best": "eval/pass@1"},
    )
    train(kept, progress=False)
    train(config_of(tiny_model, prompts_file, tmp_path / "plain", steps=2, lora=lora), progress=False)
    trained = [m for m in lines(tmp_path / "kept") if m["step"] > 0]
    assert [{k: m[k] for k in DETERMINISTIC} for m in trained] == [
        {k: m[k] for k in DETERMINISTIC} for m in lines(tmp_path / "plain")
    ]
    assert weights(tmp_path / "kept" / "best").keys() == weights(tiny_model).keys()  # merged: no adapter left


def test_a_copy_of_a_lora_policy_is_its_merged_weights_and_leaves_it_as_it_was(tiny_model, tmp_path):
    from grpo.infra.distributed import SingleProcess
    from grpo.infra.hf import load_tokenizer
    from grpo.train.checkpointing import Checkpointer
    from grpo.train.models import apply_lora

    policy = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model), 8, 32, "all-linear")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))  # adapters that change the model
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    engine = type("Engine", (), {"policy": policy, "tokenizer": load_tokenizer(tiny_model), "world": SingleProcess()})
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.e = engine
    checkpointer.save_copy(tmp_path / "copy")
    after = policy.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the adapters and base as they were
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    saved = weights(tmp_path / "copy")
    assert saved.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(saved[name], tensor)
    assert any(not torch.equal(saved[n], t) for n, t in weights(tiny_model).items())  # the adapters are in
