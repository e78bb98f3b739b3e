"""torchrun (gloo, 2 processes on the CPU) with the features that used to refuse it: LoRA,
asynchronous rollouts, a vLLM server, iterative RL. Each a real run; the core of several
processes (one step equals one process's, learning, resume, faults) is tests/train/test_distributed.py.
A file of its own so that pytest-xdist's workers (a test file each) share the torchrun runs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from grpo.config import load_config
from grpo.data import load_rows
from grpo.rewards import load_rewards
from grpo.rewards.model import RewardModel
from grpo.train.loop import build_updater
from tests.conftest import sevens_pairs
from tests.train.test_learning import gain
from tests.train.test_resume import results

from tests.train.test_distributed import ROOT, metrics_of, stop_and_go_config, torchrun, write_config


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
def test_a_server_failing_mid_run_stops_every_process_in_one_line_and_resume_continues(
    tiny_model, prompts_file, tmp_path
):
    """One run, three servers (three launches where two runs took four): the first dies as
    process 0 pushes version 2 (the other process waits for that push, and never samples);
    resumed against the second, which leaves the first generate request of step 4 unanswered
    (one process's; the other's is answered). Each time every process stops with one line,
    the checkpoint of the last whole step (2, then 3) saved by both, none left waiting in a
    collective (a 60 s limit); --resume against the third runs to the end."""
    from tests.rollout.fake_vllm_server import FakeServer
    from tests.train.test_faults import checkpoints, our_lines

    servers = [FakeServer(tiny_model, die_at_push=3), FakeServer(tiny_model, drop_at=3), FakeServer(tiny_model)]
    try:
        config = server_config(tiny_model, prompts_file, tmp_path / "run", servers[0].address, 4)
        config["rollout"]["vllm"]["timeout"] = 20
        path = write_config(tmp_path, "dying", config)
        for server, during, step, resume in (
            (servers[0], "the weight push", 2, ()),
            (servers[1], "generation", 3, ("--resume",)),
        ):
            against = f"rollout.vllm.server={server.address}"
            failed = torchrun("-m", "grpo", "train", str(path), "--quiet", *resume, "--set", against, timeout=60)
            assert failed.returncode != 0, failed.stderr[-3000:]
            (line,) = our_lines(failed.stderr)
            said = f"grpo: error: the vLLM server at {server.address} stopped answering during {during} ("
            assert line.startswith(said) and f"checkpoint of step {step} saved" in line, failed.stderr[-3000:]
            assert str(ROOT / "grpo") not in failed.stderr  # no traceback through our code
            assert checkpoints(tmp_path / "run")[-1:] == [f"step-{step:06d}"]
        assert checkpoints(tmp_path / "run") == ["step-000002", "step-000003"]
        resumed = torchrun(
            "-m",
            "grpo",
            "train",
            str(path),
            "--quiet",
            "--resume",
            "--set",
            f"rollout.vllm.server={servers[2].address}",
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [m["step"] for m in metrics_of(tmp_path / "run")] == [1, 2, 3, 4]
    finally:
        for server in servers:
            if not server.gone:
                server.close()


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
        # AdamW's first steps move a weight by about lr whatever its gradient's size, so a
        # gradient that is float rounding in both runs may move either way: compare the whole
        # update's norm, which a few such weights barely change and a wrong gradient does.
        names = list(after)
        two = torch.cat([(zero["weights"][k] - before[k]).flatten().double() for k in names])
        alone = torch.cat([(after[k] - before[k]).flatten().double() for k in names])
        gap = float((two - alone).norm() / alone.norm())
        assert gap < 0.02, (update, gap)
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
