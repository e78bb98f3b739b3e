"""Many processes, one program: torchrun with gloo on the CPU, 2 processes.

- world-size invariance: one optimizer step on a fixed rollout gives the same weights in
  2 processes as in 1 (GRPO in each aggregation mode, batch scaling, dropped groups; PPO;
  LoRA: the adapters, what a sampler is sent, the reference's reset, final/);
- a 2-process run of the tiny model learns, and its final/ is one plain HF directory;
- a 2-process run killed with SIGKILL and resumed, then stopped by one process's failing
  reward and resumed, writes the metrics of one never interrupted; its bf16 reference is
  reset from the sharded policy;
- 2 nodes x 1 process through torchrun's c10d rendezvous on 127.0.0.1 run the same program:
  the same metrics as 1 node x 2 processes;
- bad launches stop every process with one line from process 0.

LoRA, asynchronous rollouts, a vLLM server and iterative RL under torchrun:
tests/train/test_distributed_features.py.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from grpo.infra.hf import load_tokenizer
from tests.helpers import assert_same_metrics
from tests.train.test_learning import gain
from tests.train.test_resume import DETERMINISTIC, results
from tests.train.world_worker import CASES, run_all

pytestmark = pytest.mark.torchrun

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(*args, nproc=2, timeout=300, env=None):
    """Run torchrun to its end; past `timeout` (a process left waiting) it is stopped, and
    subprocess.TimeoutExpired raised."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**ENV, **(env or {})}
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.terminate()  # torchrun stops its workers (each in a session of its own): none left behind
            run.communicate(timeout=60)
            raise
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def write_config(tmp_path, name, config):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def metrics_of(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def moved_policy(tiny_model, tmp_path_factory):
    """The tiny model with every weight moved by seeded noise: the step's starting policy
    (the reference stays the tiny model)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    directory = tmp_path_factory.mktemp("moved")
    model.save_pretrained(directory)
    load_tokenizer(tiny_model).save_pretrained(directory)
    return str(directory)


def test_one_step_on_two_processes_equals_one_step_on_one(moved_policy, tiny_model, prompts_file, tmp_path):
    out = tmp_path / "two.pt"
    run = torchrun("-m", "tests.train.world_worker", moved_policy, tiny_model, prompts_file, str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    two = torch.load(out)
    one = run_all(moved_policy, tiny_model, prompts_file)
    assert set(two) == set(one) == set(CASES)
    start = AutoModelForCausalLM.from_pretrained(moved_policy).state_dict()
    for case, (_, _, train, lora) in CASES.items():
        (weights_2, metrics_2), (weights_1, metrics_1) = two[case], one[case]
        assert set(weights_2) == set(weights_1), case
        if lora:
            only_the_adapters_moved(weights_1, start, case)
        else:
            assert any(not torch.equal(weights_1[f"policy.{k}"], start[k]) for k in start), (
                case
            )  # the step moved the policy
        for name in weights_1:
            torch.testing.assert_close(weights_2[name], weights_1[name], rtol=1e-5, atol=1e-6, msg=f"{case}: {name}")
        # clip_fraction over several epochs is a mean over micro-batches weighted by their rows:
        # not one over tokens when split
        split = train.get("epochs", 1) > 1
        assert_same_metrics(metrics_2, metrics_1, [k for k in metrics_1 if not (split and k == "clip_fraction")])
    assert two["grpo-drop-zero-std-groups"][1]["tokens/trained"] < two["grpo-seq-mean-token-mean"][1]["tokens/trained"]


def base_weights(weights, prefix):
    """A LoRA policy's base weights under the plain model's names."""
    return {
        k.removeprefix(f"{prefix}.base_model.model.").replace(".base_layer", ""): v
        for k, v in weights.items()
        if k.startswith(f"{prefix}.") and ".lora_" not in k
    }


def only_the_adapters_moved(weights, start, case):
    """LoRA: the base weights are the starting policy's, every adapter moved (lora_B starts at
    0), and what a sampler is sent (read from the shards or gathered) is the base with the
    adapters merged in; so is the base after the reference's reset (its adapters back at 0),
    and final/."""
    base = base_weights(weights, "policy")
    assert base.keys() == start.keys(), case
    assert all(torch.equal(base[k], start[k]) for k in start), case
    assert all(v.abs().max() > 0 for k, v in weights.items() if ".lora_B." in k and k.startswith("policy.")), case
    assert all(not v.any() for k, v in weights.items() if ".lora_B." in k and k.startswith("reset.")), case
    merged = [k for k in start if f"policy.base_model.model.{k.replace('.weight', '.base_layer.weight')}" in weights]
    assert len(merged) == 14, case  # every linear layer but the head: 7 a block
    reset = base_weights(weights, "reset")
    for k in start:
        torch.testing.assert_close(reset[k], weights[f"published.{k}"], msg=f"{case}: reset {k}")
        for where in ("gathered", "final"):
            torch.testing.assert_close(weights[f"{where}.{k}"], weights[f"published.{k}"], msg=f"{case}: {where}.{k}")
        assert torch.equal(weights[f"published.{k}"], start[k]) == (k not in merged), (case, k)


@pytest.fixture(scope="module")
def two_process_run(tiny_model, prompts_file, tmp_path_factory):
    """40 steps of the learning test's GRPO run, in 2 processes, with --overwrite over an earlier
    run's metrics."""
    tmp = tmp_path_factory.mktemp("two")
    config = {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(tmp / "run"),
        "data": {"path": prompts_file},
        "rewards": [
            {"function": "tests.train.rewards_for_tests:sevens"},
            {"function": "tests.train.rewards_for_tests:process_logged", "weight": 0.0},  # logs its rank
        ],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": 40, "lr": 1e-3, "sample_every": 10},
        "loss": {"beta": 0.04},
    }
    path = write_config(tmp, "config", config)
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # an earlier run's: --overwrite
    run = torchrun("-m", "grpo", "train", str(path), "--quiet", "--overwrite")
    return config, run


@pytest.mark.learning
def test_a_two_process_run_learns_and_saves_one_plain_model(two_process_run, tiny_model):
    config, run = two_process_run
    assert run.returncode == 0, run.stderr[-3000:]
    out = Path(config["output_dir"])
    metrics = metrics_of(out)
    assert [m["step"] for m in metrics] == list(range(1, 41))  # process 0 alone writes: one line per step
    assert gain(metrics) >= 0.25, [round(m["reward/mean"], 3) for m in metrics]
    assert all(m["tokens/completion"] == 4 * 8 * 8 for m in metrics)  # every process's completions counted
    assert all(m["process"] == 0.5 for m in metrics)  # log_metric's calls of both processes, ranks 0 and 1
    assert run.stdout.count('"output_dir"') == 1  # one summary line, from process 0
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in final.state_dict().items())
    assert sorted(p.name for p in (out / "checkpoints" / "step-000040").iterdir()) == [
        "manifest.json",
        "rank-00000.pt",
        "rank-00001.pt",
        "shards",
        "state.pt",
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_c10d_rendezvous_run_the_same_program(two_process_run, tmp_path):
    """Two torchrun agents (one process each) meet at 127.0.0.1: the run is the same as one
    agent with two processes (process r samples the same prompts with the same seed)."""
    config, _ = two_process_run
    config = {**config, "output_dir": str(tmp_path / "nodes"), "train": {**config["train"], "steps": 3}}
    path = write_config(tmp_path, "nodes", config)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "grpo-test",
                "-m",
                "grpo",
                "train",
                str(path),
                "--quiet",
            ],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [agent.communicate(timeout=300) for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    nodes = [{k: m[k] for k in DETERMINISTIC} for m in metrics_of(tmp_path / "nodes")]
    one_node = [{k: m[k] for k in DETERMINISTIC} for m in metrics_of(two_process_run[0]["output_dir"])[:3]]
    assert nodes == one_node


def stop_and_go_config(tiny_model, prompts_file, output_dir, reward, **train):
    """6 steps in 2 iterations (the reference is reset at step 4), checkpoints at 2 and 4;
    `train`: more of train's settings."""
    return {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(output_dir),
        "data": {"path": prompts_file},
        "rewards": [{"function": f"tests.train.rewards_for_tests:{reward}"}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": 6, "iterations": 2, "checkpoint_every": 2, "lr": 1e-3, "sample_every": 2, **train},
        "loss": {"beta": 0.04},
    }


@pytest.fixture(scope="module")
def straight_two_process_run(tiny_model, prompts_file, tmp_path_factory):
    """The stop-and-go run, straight through, its reference a bf16 copy."""
    tmp = tmp_path_factory.mktemp("straight")
    config = stop_and_go_config(tiny_model, prompts_file, tmp / "run", "sevens", reference_dtype="bfloat16")
    path = write_config(tmp, "straight", config)
    run = torchrun("-m", "grpo", "train", str(path), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    return results(tmp / "run")


@pytest.mark.resume
def test_a_killed_then_failing_two_process_run_resumes_as_if_never_interrupted(
    straight_two_process_run, tiny_model, prompts_file, tmp_path
):
    """One run stopped twice (three launches where two runs took four): every process
    SIGKILLs itself inside step 5 (its 5th reward call), the checkpoint of step 4 left; resumed,
    process 1's reward raises in step 6 (the resumed processes' 2nd call): every process stops
    (none waits in a collective), process 0 prints the one line, and they save step 5
    together (a step the periodic checkpoints, at 2, 4 and 6, would not have kept: this checks
    the save); resumed again, the run ends as the straight one did."""
    reward = "sevens_then_die_or_raise_in_rank_1"
    config = stop_and_go_config(tiny_model, prompts_file, tmp_path / "run", reward, reference_dtype="bfloat16")
    path = write_config(tmp_path, "run", config)
    killed = torchrun("-m", "grpo", "train", str(path), "--quiet", env={"GRPO_TEST_DIE_AT": "5"})
    assert killed.returncode != 0
    assert [m["step"] for m in results(tmp_path / "run")] == [1, 2, 3, 4]
    failed = torchrun(
        "-m", "grpo", "train", str(path), "--quiet", "--resume", env={"GRPO_TEST_RAISE_AT": "2"}, timeout=120
    )
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("grpo:")]
    assert len(ours) == 1 and "the judge is down" in ours[0] and "checkpoint of step 5 saved" in ours[0], failed.stderr[
        -3000:
    ]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())[-1] == "step-000005"
    assert [m["step"] for m in results(tmp_path / "run")] == [1, 2, 3, 4, 5]
    resumed = torchrun("-m", "grpo", "train", str(path), "--quiet", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(tmp_path / "run") == straight_two_process_run
    assert [m["iteration"] for m in results(tmp_path / "run")] == [1, 1, 1, 2, 2, 2]


def test_a_bf16_reference_under_torchrun_resets_from_the_sharded_policy(straight_two_process_run):
    """The stop-and-go run's bf16 reference (a full replica; FSDP2 shards the policy) is reset
    from the policy's gathered shards before step 4, whose KL is bf16's rounding again, as
    step 1's is, where the other steps measure the policy's moves."""
    kl = [m["kl"] for m in straight_two_process_run]
    assert kl[0] > 0 and kl[3] > 0, kl  # bf16 rounding: an fp32 copy of the same weights gives 0
    assert min(kl[1], kl[2], kl[4], kl[5]) > 10 * max(kl[0], kl[3]), kl


def test_overwrite_under_torchrun_starts_afresh_in_every_process(two_process_run):
    """Only process 0 clears the folder (the 2-process run's, which held an earlier run's
    metrics); the others must not take the old run for a reason to stop."""
    config, run = two_process_run
    assert run.returncode == 0, run.stderr[-3000:]
    assert [m["step"] for m in metrics_of(config["output_dir"])] == list(range(1, 41))


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"rollout": {"prompts_per_step": 3}},
            "rollout.prompts_per_step: 3 prompts cannot be split evenly over 2 processes",
        ),
        ({"train": {"backend": "nccl", "device": "cpu"}}, "train.backend: nccl needs CUDA devices"),
    ],
)
def test_a_bad_launch_stops_every_process_with_one_line(make_config, tmp_path, settings, message):
    path = write_config(tmp_path, "bad", make_config(**settings))
    run = torchrun("-m", "grpo", "train", str(path), "--quiet")
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("grpo: error:")]
    assert len(ours) == 1 and message in ours[0], run.stderr[-2000:]
    assert str(ROOT / "grpo") not in run.stderr  # no traceback through our code (torchrun prints its own summary)


def test_with_a_seed_per_prompt_a_run_does_not_depend_on_the_number_of_processes(make_config, tmp_path):
    """rollout.seed_per_prompt: each prompt samples from a seed of (run seed, step, its index
    in the step's batch), so 2 processes draw the same completions as 1 and the run's
    metrics agree (up to the float rounding of sums split over processes)."""
    import grpo

    settings = dict(
        rollout={
            "group_size": 8,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "min_new_tokens": 0,
            "seed_per_prompt": True,
        },
        train={"steps": 3, "lr": 1e-2, "sample_every": 1, "device": "cpu"},
    )
    one = make_config(**settings, output_dir=str(tmp_path / "one"))
    two = make_config(**settings, output_dir=str(tmp_path / "two"))
    grpo.train(one, progress=False)
    run = torchrun("-m", "grpo", "train", str(write_config(tmp_path, "two", two)), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    m1, m2 = metrics_of(tmp_path / "one"), metrics_of(tmp_path / "two")
    for a, b in zip(m1, m2, strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["tokens/completion"] == b["tokens/completion"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    samples = [(tmp_path / name / "samples.jsonl").read_text() for name in ("one", "two")]
    assert samples[0] == samples[1]  # the first prompt's group, step by step: the same completions
    assert len({m["reward/mean"] for m in m1}) > 1  # the steps sampled differently
