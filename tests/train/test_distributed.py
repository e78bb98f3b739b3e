"""Many processes, one program: torchrun with gloo on the CPU, 2 processes.

- world-size invariance: one optimizer step on a fixed rollout gives the same weights in
  2 processes as in 1 (GRPO in each aggregation mode, batch scaling, dropped groups; PPO;
  LoRA: the adapters, what a sampler is sent, the reference's reset, final/);
- a 2-process run of the tiny model learns, and its final/ is one plain HF directory; so
  does a LoRA one, which resumes from its checkpoint as if never stopped;
- a 2-process run killed with SIGKILL and resumed writes the metrics of one never interrupted;
- iterative RL: each process samples its part of an update's prompts, the reward model's
  replicas end every update the same, and as one process's update on all the samples; a
  killed iterative run resumes with its updated reward model;
- a vLLM server shared by 2 processes (a fake one, in this process): one push per version,
  by process 0, every generate request with that version's token, and the run learns; a
  push or a generate request that fails stops both processes in one line, and resumes;
- 2 nodes x 1 process through torchrun's c10d rendezvous on 127.0.0.1 run the same program:
  the same metrics as 1 node x 2 processes;
- bad launches stop every process with one line from process 0.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from grpo.config import load_config
from grpo.data import load_rows
from grpo.infra.hf import load_tokenizer
from grpo.rewards import load_rewards
from grpo.rewards.model import RewardModel
from grpo.train.loop import build_updater
from tests.conftest import sevens_pairs
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
        for key in metrics_1:
            if key == "clip_fraction" and train.get("epochs", 1) > 1:
                continue  # a mean over micro-batches weighted by their rows: not one over tokens when split
            assert metrics_2[key] == pytest.approx(metrics_1[key], rel=1e-5, abs=1e-7), (case, key)
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
    """40 steps of the learning test's GRPO run, in 2 processes."""
    tmp = tmp_path_factory.mktemp("two")
    config = {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(tmp / "run"),
        "data": {"path": prompts_file},
        "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": 40, "lr": 1e-3, "sample_every": 10},
        "loss": {"beta": 0.04},
    }
    path = write_config(tmp, "config", config)
    run = torchrun("-m", "grpo", "train", str(path), "--quiet")
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


def stop_and_go_config(tiny_model, prompts_file, output_dir, reward):
    """6 steps in 2 iterations (the reference is reset at step 4), checkpoints at 2 and 4."""
    return {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(output_dir),
        "data": {"path": prompts_file},
        "rewards": [{"function": f"tests.train.rewards_for_tests:{reward}"}],
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": 6, "iterations": 2, "checkpoint_every": 2, "lr": 1e-3, "sample_every": 2},
        "loss": {"beta": 0.04},
    }


@pytest.fixture(scope="module")
def straight_two_process_run(tiny_model, prompts_file, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    path = write_config(tmp, "straight", stop_and_go_config(tiny_model, prompts_file, tmp / "run", "sevens"))
    run = torchrun("-m", "grpo", "train", str(path), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    return results(tmp / "run")


@pytest.mark.resume
def test_a_killed_two_process_run_resumes_as_if_never_interrupted(
    straight_two_process_run, tiny_model, prompts_file, tmp_path
):
    # Every process SIGKILLs itself inside step 5 (its 5th reward call).
    path = write_config(
        tmp_path, "killed", stop_and_go_config(tiny_model, prompts_file, tmp_path / "killed", "sevens_then_die")
    )
    killed = torchrun("-m", "grpo", "train", str(path), "--quiet", env={"GRPO_TEST_DIE_AT": "5"})
    assert killed.returncode != 0
    assert [m["step"] for m in results(tmp_path / "killed")] == [1, 2, 3, 4]
    resumed = torchrun("-m", "grpo", "train", str(path), "--quiet", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(tmp_path / "killed") == straight_two_process_run
    assert [m["iteration"] for m in results(tmp_path / "killed")] == [1, 1, 1, 2, 2, 2]


@pytest.fixture(scope="module")
def lora_two_process_run(tiny_model, prompts_file, tmp_path_factory):
    """12 steps of LoRA (r 16, alpha 64: what learns on the tiny model) in 2 processes, in 2
    iterations (the reference, the policy with its adapters off, catches up at step 6 by
    merging them into the base weights), checkpoints at 10 and 12."""
    tmp = tmp_path_factory.mktemp("lora")
    config = stop_and_go_config(tiny_model, prompts_file, tmp / "run", "sevens")
    config["train"].update(steps=12, checkpoint_every=10, lr=1e-2, sample_every=0)
    config["lora"] = {"r": 16, "alpha": 64}
    path = write_config(tmp, "lora", config)
    run = torchrun("-m", "grpo", "train", str(path), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    return path, Path(config["output_dir"])


@pytest.mark.learning
def test_a_two_process_lora_run_learns_and_saves_the_adapters_merged(lora_two_process_run, tiny_model):
    _, out = lora_two_process_run
    metrics = metrics_of(out)
    rewards = [round(m["reward/mean"], 3) for m in metrics]
    # LoRA on the tiny model rises from the base's 1 in 14 sevens within a few steps, then slowly.
    assert sum(rewards[-6:]) / 6 >= sum(rewards[:2]) / 2 + 0.05, rewards
    assert metrics[6]["kl"] < 1e-6 < metrics[5]["kl"]  # the reference caught up with the policy at the reset
    final = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert final.keys() == initial.keys()  # a plain model: no adapter left
    assert json.loads((out / "final" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not torch.equal(
        final["model.layers.0.self_attn.q_proj.weight"], initial["model.layers.0.self_attn.q_proj.weight"]
    )


@pytest.mark.resume
def test_a_stopped_two_process_lora_run_resumes_as_if_never_interrupted(lora_two_process_run, tmp_path):
    """The run's folder as a kill inside step 11 leaves it (the checkpoint of step 10, its
    metrics), resumed: the adapters, the base weights the reset merged them into and their
    AdamW state come back, and steps 11 and 12 are the straight run's."""
    path, out = lora_two_process_run
    stopped = tmp_path / "run"
    shutil.copytree(out, stopped, ignore=shutil.ignore_patterns("step-000012", "final", "summary.json"))
    (stopped / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()[:10])
    )
    config = yaml.safe_load(path.read_text())
    resumed = torchrun(
        "-m",
        "grpo",
        "train",
        str(write_config(tmp_path, "resumed", {**config, "output_dir": str(stopped)})),
        "--quiet",
        "--resume",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(stopped) == results(out)


def test_a_reward_failing_in_one_process_stops_all_with_a_checkpoint(
    straight_two_process_run, tiny_model, prompts_file, tmp_path
):
    """Process 1's reward raises in step 3: every process stops (none waits in a collective),
    process 0 prints the one line, and they save step 2 together (a step the periodic
    checkpoints would not have kept: they are at 2 and 4, so this checks the save)."""
    config = stop_and_go_config(tiny_model, prompts_file, tmp_path / "failed", "sevens_then_raise_in_rank_1")
    config["train"]["checkpoint_every"] = 0
    path = write_config(tmp_path, "failed", config)
    failed = torchrun("-m", "grpo", "train", str(path), "--quiet", env={"GRPO_TEST_RAISE_AT": "3"}, timeout=120)
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("grpo:")]
    assert len(ours) == 1 and "the judge is down" in ours[0] and "checkpoint of step 2 saved" in ours[0], failed.stderr[
        -3000:
    ]
    assert sorted(p.name for p in (tmp_path / "failed" / "checkpoints").iterdir()) == ["step-000002"]
    resumed = torchrun("-m", "grpo", "train", str(path), "--quiet", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(tmp_path / "failed") == straight_two_process_run


def test_overwrite_under_torchrun_starts_afresh_in_every_process(make_config, tmp_path):
    """Only process 0 clears the folder; the others must not take the old run for a reason to stop."""
    config = make_config(train={"steps": 1, "lr": 1e-3})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # an earlier run's
    run = torchrun("-m", "grpo", "train", str(write_config(tmp_path, "again", config)), "--quiet", "--overwrite")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [m["step"] for m in metrics_of(tmp_path / "run")] == [1]


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


@pytest.mark.learning
@pytest.mark.resume
def test_async_rollouts_on_two_processes_learn_and_resume(tiny_model, prompts_file, tmp_path):
    """rollout.async under torchrun: a generator process per trainer process, each sampling
    its share of whole prompts. Killed inside step 13 (every process), resumed from the
    checkpoint of step 12: the run ends at step 30, with every step's completions counted over
    both processes, the first batch after the resume fresh (staleness 0), and the reward up."""
    config = {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": prompts_file},
        "rewards": [{"function": "tests.train.rewards_for_tests:sevens_then_die"}],
        "rollout": {
            "group_size": 8,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "min_new_tokens": 8,
            "seed_per_prompt": True,
            "async": {"max_staleness": 1},
        },
        "train": {"steps": 30, "checkpoint_every": 4, "lr": 2e-3, "sample_every": 0},
        "loss": {"beta": 0.04},
    }
    path = write_config(tmp_path, "async", config)
    killed = torchrun("-m", "grpo", "train", str(path), "--quiet", env={"GRPO_TEST_DIE_AT": "13"})
    assert killed.returncode != 0
    assert [m["step"] for m in metrics_of(tmp_path / "run")] == list(range(1, 13))
    resumed = torchrun("-m", "grpo", "train", str(path), "--quiet", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = metrics_of(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert all(m["tokens/completion"] == 4 * 8 * 8 for m in metrics)  # both processes' groups, whole
    assert [m["async/staleness"] for m in metrics] == ([0] + [1] * 11) * 1 + [0] + [1] * 17
    # Each process's generator samples with the weights its trainer published: on the fresh
    # batches (steps 1 and 13) the sampler's log-probs are the trainer's, up to float noise
    # (0.002-0.003 here; 0.13 when process 1's generator kept the weights it started with).
    fresh = [m["rollout/mismatch_kl"] for m in metrics if m["async/staleness"] == 0]
    assert len(fresh) == 2 and max(fresh) < 0.02, fresh
    assert gain(metrics) >= 0.25, [round(m["reward/mean"], 3) for m in metrics]


def server_config(tiny_model, prompts_file, output_dir, address, steps):
    """The fault tests' GRPO run, sampled by the vLLM server at `address`."""
    from tests.train.test_faults import config_for

    config = config_for(tiny_model, prompts_file, output_dir, steps=steps, lr=1e-2, sample_every=0)
    config["rollout"].update(sampler="vllm", vllm={"server": address, "timeout": 60})
    return config


@pytest.mark.learning
def test_two_processes_share_one_server_one_push_per_version_and_learn(tiny_model, prompts_file, tmp_path):
    """rollout.vllm.server under torchrun: process 0 alone pushes each version of the weights
    (gathered whole), every process waits for that push and takes its token, then samples
    its share of the step's prompts (2 whole groups) from the server; the run learns. The
    server is a fake in this process (tests/rollout/fake_vllm_server.py), which logs what
    it served: per step one push, then two generate requests with that push's weights."""
    from tests.rollout.fake_vllm_server import FakeServer

    steps = 20
    server = FakeServer(tiny_model)
    try:
        config = server_config(tiny_model, prompts_file, tmp_path / "run", server.address, steps)
        run = torchrun("-m", "grpo", "train", str(write_config(tmp_path, "served", config)), "--quiet", timeout=180)
        log = server.served.log
    finally:
        server.close()
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = metrics_of(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["tokens/completion"] == 4 * 8 * 8 for m in metrics)  # both processes' groups, whole
    assert [entry[0] for entry in log] == ["push", "generate", "generate"] * steps, log
    pushes = log[::3]
    assert len({push[2] for push in pushes}) == steps  # each version's weights, once
    for step, push in enumerate(pushes):
        for generate in log[3 * step + 1 : 3 * step + 3]:
            assert generate == ("generate", [8, 8], step + 1, push[1]), (step, log)
    assert gain(metrics) >= 0.25, [round(m["reward/mean"], 3) for m in metrics]


@pytest.mark.resume
@pytest.mark.parametrize(
    ("fault", "during"),
    [({"die_at_push": 3}, "the weight push"), ({"drop_at": 5}, "generation")],
    ids=["push", "generate"],
)
def test_a_server_failing_mid_run_stops_every_process_in_one_line_and_resume_continues(
    tiny_model, prompts_file, tmp_path, fault, during
):
    """The server dies as process 0 pushes version 2 (the other process waits for that push,
    and never samples), or leaves the first generate request of step 3 unanswered (one
    process's; the other's is answered): every process stops with one line, step 2's
    checkpoint saved by both, none left waiting in a collective (a 60 s limit); --resume
    against another server runs to the end."""
    from tests.rollout.fake_vllm_server import FakeServer
    from tests.train.test_faults import checkpoints, our_lines

    dying, fresh = FakeServer(tiny_model, **fault), FakeServer(tiny_model)
    try:
        config = server_config(tiny_model, prompts_file, tmp_path / "run", dying.address, 4)
        config["rollout"]["vllm"]["timeout"] = 20
        path = write_config(tmp_path, "dying", config)
        failed = torchrun("-m", "grpo", "train", str(path), "--quiet", timeout=60)
        assert failed.returncode != 0, failed.stderr[-3000:]
        (line,) = our_lines(failed.stderr)
        said = f"grpo: error: the vLLM server at {dying.address} stopped answering during {during} ("
        assert line.startswith(said) and "checkpoint of step 2 saved" in line, failed.stderr[-3000:]
        assert str(ROOT / "grpo") not in failed.stderr  # no traceback through our code
        assert checkpoints(tmp_path / "run") == ["step-000002"]
        resumed = torchrun(
            "-m", "grpo", "train", str(path), "--quiet", "--resume", "--set", f"rollout.vllm.server={fresh.address}"
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [m["step"] for m in metrics_of(tmp_path / "run")] == [1, 2, 3, 4]
    finally:
        fresh.close()
        if not dying.gone:
            dying.close()


def iterative_config(tiny_model, prompts_file, tmp, name):
    """3 steps in 3 iterations: the reward model (untrained, from the tiny base) is updated
    before steps 2 and 3 on 3 prompts (1 sampled by process 0, 2 by process 1), 4 pairs a
    batch (2 each), with a replay of the 8 pairs of `data`; checkpoints at 2 and 3."""
    rm_dir = tmp / "rm"
    if not rm_dir.exists():
        RewardModel.from_base(tiny_model, seed=0).save(rm_dir)
        (tmp / "history.jsonl").write_text("".join(json.dumps(p) + "\n" for p in sevens_pairs(8, seed=3)))
    config = {
        "algorithm": "grpo",
        "model": tiny_model,
        "seed": 0,
        "output_dir": str(tmp / name),
        "data": {"path": prompts_file},
        "rewards": [
            {"model": str(rm_dir)},
            {"function": "tests.train.rewards_for_tests:sevens_then_die", "weight": 0.0},
        ],
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 8, "min_new_tokens": 8},
        "train": {"steps": 3, "iterations": 3, "checkpoint_every": 2, "lr": 1e-3, "sample_every": 0},
        "loss": {"beta": 0.04},
        "reward_model_update": {
            "verifier": "tests.train.rewards_for_tests:sevens",
            "data": str(tmp / "history.jsonl"),
            "prompts": 3,
            "samples_per_prompt": 4,
            "max_pairs_per_prompt": 4,
            "replay": 0.25,
            "batch_size": 4,
            "lr": 1e-3,
        },
    }
    return write_config(tmp, name, config), str(rm_dir)


@pytest.fixture(scope="module")
def iterative_run(tiny_model, prompts_file, tmp_path_factory):
    """The 2-process iterative run, each process's updates recorded (tests/train/iterative_worker.py)."""
    tmp = tmp_path_factory.mktemp("iterative")
    path, rm_dir = iterative_config(tiny_model, prompts_file, tmp, "straight")
    run = torchrun("-m", "tests.train.iterative_worker", str(path), str(tmp), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [torch.load(tmp / f"rank-{r}.pt") for r in (0, 1)]
    return path, rm_dir, ranks


def test_iterative_rl_on_two_processes_updates_one_reward_model_as_one_process_would(iterative_run):
    """Each process samples its part of the update's prompts (whole groups); the replicas end
    every update the same, and the same (up to float rounding) as one process learning from
    both processes' samples: what a process training on its own pairs alone, or without
    summing the gradients, would not give."""
    path, rm_dir, ranks = iterative_run
    assert [len(r) for r in ranks] == [2, 2]  # two updates, in each process
    assert [[len(u["completions"]) for u in r] for r in ranks] == [[4, 4], [8, 8]]  # 1 prompt and 2, x4 samples
    c = load_config(path)
    u = c.reward_model_update
    rows = load_rows(c.data.path, prompt_column=c.data.prompt_column)
    one = build_updater(c, load_rewards([(u.verifier, 1.0)])[0], {0: RewardModel.from_pretrained(rm_dir)}, rows)
    before = {k: v.clone() for k, v in one.model.model.state_dict().items()}
    for update in range(2):
        zero, first = ranks[0][update], ranks[1][update]
        for name in zero["weights"]:
            assert torch.equal(zero["weights"][name], first["weights"][name]), (update, name)
        # Each update starts from the 2-process weights before it: AdamW would grow one
        # update's float rounding in the next.
        one.model.model.load_state_dict(before)
        samples = [zero[k] + first[k] for k in ("prompts", "completions", "labels")]  # rank order
        stats = one.learn(*samples)  # one process, both processes' samples
        assert stats == pytest.approx(zero["stats"], rel=1e-5) and stats["new_pairs"] >= 8, (stats, zero["stats"])
        after = one.model.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in after), update  # the reward model moved
        for name in after:
            torch.testing.assert_close(
                zero["weights"][name], after[name], rtol=1e-5, atol=2e-5, msg=f"{update}: {name}"
            )
        before = zero["weights"]
    out = Path(c.output_dir)
    assert len((out / "reward_model_updates.jsonl").read_text().splitlines()) == 2  # process 0 alone writes
    saved = torch.load(out / "checkpoints" / "step-000003" / "state.pt", weights_only=True)
    for name, value in saved["reward_model_update"]["model"].items():
        assert torch.equal(value, ranks[0][1]["weights"][name]), name  # the checkpoint holds the updated model


@pytest.mark.resume
def test_a_killed_two_process_iterative_run_resumes_with_its_updated_reward_model(
    iterative_run, tiny_model, prompts_file
):
    """Killed inside step 3 (after the second update), resumed from step 2's checkpoint,
    which holds the once-updated reward model: the run redoes the second update from it and
    ends as the straight run did (metrics, updates, reward model)."""
    path, _, _ = iterative_run
    tmp = path.parent
    killed_path, _ = iterative_config(tiny_model, prompts_file, tmp, "killed")
    killed = torchrun("-m", "grpo", "train", str(killed_path), "--quiet", env={"GRPO_TEST_DIE_AT": "3"}, timeout=180)
    assert killed.returncode != 0
    assert [m["step"] for m in results(tmp / "killed")] == [1, 2]
    resumed = torchrun("-m", "grpo", "train", str(killed_path), "--quiet", "--resume", timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(tmp / "killed") == results(tmp / "straight")
    updates = [(tmp / run / "reward_model_updates.jsonl").read_text() for run in ("straight", "killed")]
    assert updates[0] == updates[1]
    models = [
        torch.load(tmp / run / "checkpoints" / "step-000003" / "state.pt", weights_only=True)["reward_model_update"]
        for run in ("straight", "killed")
    ]
    for name, value in models[0]["model"].items():
        assert torch.equal(value, models[1]["model"][name]), name
