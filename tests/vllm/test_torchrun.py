"""`rollout.sampler: vllm` under torchrun: 2 processes (gloo on the CPU, the policy sharded
with FSDP2), each with its own vLLM engine in the process, built once on torchrun's process
group and fed the whole policy after every optimizer step. In every process and at every
step, the engine's log-probs of the tokens it drew are the trainer's (fp32: within
models.WORST_GAP), the run learns, and it ends cleanly (vLLM's shutdown leaves the trainer's
process group alone)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.test_learning import gain
from tests.vllm.models import WORST_GAP, save

pytestmark = [pytest.mark.vllm, pytest.mark.torchrun]

ROOT = Path(__file__).parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def run(prompts_file, tmp_path_factory):
    """A GRPO run of STEPS steps on a tiny Qwen2 (tied head, QKV bias) in 2 processes."""
    tmp = tmp_path_factory.mktemp("torchrun")
    config = {
        "algorithm": "grpo",
        "model": str(save("qwen2", tmp / "model")),
        "seed": 0,
        "output_dir": str(tmp / "run"),
        "data": {"path": prompts_file},
        "rewards": [{"function": "tests.train.rewards_for_tests:sevens"}],
        "rollout": {
            "group_size": 8,
            "prompts_per_step": 4,
            "max_new_tokens": 8,
            "sampler": "vllm",
            "vllm": {"max_num_seqs": 32},
        },
        "train": {"steps": STEPS, "lr": 3e-3},
        "loss": {"beta": 0.0},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "tests.vllm.torchrun_worker", str(path), str(tmp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    return config, tmp, done


def test_two_processes_each_sample_from_an_engine_holding_the_whole_policy(run):
    config, tmp, done = run
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        record = json.loads((tmp / f"rank-{rank}.json").read_text())
        assert record["engines"] == 1  # built once for the run, not per step
        assert record["group_kept"] == [True]  # the engine shut down, torchrun's process group left to the trainer
        assert len(record["calls"]) == STEPS
        for step, call in enumerate(record["calls"], 1):
            assert call["tokens"] > 0
            assert call["max_gap"] < WORST_GAP, (rank, step, call)


def test_the_two_process_run_learns_and_ends_cleanly(run):
    config, tmp, done = run
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = [json.loads(line) for line in (Path(config["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["tokens/completion"] > 4 * 8 * 4 for m in metrics)  # both processes' completions counted
    assert gain(metrics, k=3) > 0.1, [round(m["reward/mean"], 3) for m in metrics]
    assert "Traceback" not in done.stderr  # no failed shutdown at exit either
