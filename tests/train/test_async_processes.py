"""The generator process of rollout.async may start processes, and leaves none behind: a tool
that computes in a process pool answers as in a synchronous run (a daemonic generator may not
start one, and its tool calls would fail); a trainer killed (SIGKILL) takes its generator and
the tool's pool with it; a trainer that exits without closing its generator does not hang."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import grpo
from tests.rollout.tool_models import MULTIPLY_PROMPT
from tests.train.test_async import generators
from tests.train.test_tools_training import run_config

ROOT = Path(__file__).parents[2]
TOOLS = ["tests.rollout.tools_with_processes:pooled", "tests.rollout.tool_models:async_add"]


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped by its adopter, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def samples(output_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_tool_with_a_process_pool_answers_under_async_as_in_a_synchronous_run(tool_model, tmp_path):
    """The same first step (the same weights and seed: the same draws) with and without
    rollout.async: the same conversations, every call answered (none failed)."""
    runs = {}
    for mode in ("sync", "async"):
        (tmp_path / mode).mkdir()
        config = run_config(tool_model, tmp_path / mode, [{"prompt": MULTIPLY_PROMPT}] * 2, tools=TOOLS)
        config["output_dir"] = str(tmp_path / mode / "run")
        config["rewards"] = [{"function": "tests.train.test_tools_training:correct"}]
        if mode == "async":
            config["rollout"]["async"] = {"max_staleness": 1}
        (metrics,) = grpo.train(config, progress=False).metrics
        runs[mode] = metrics, samples(config["output_dir"])
    for metrics, _ in runs.values():
        assert metrics["tools/calls_per_rollout"] > 0 and metrics["tools/failures"] == 0
    answers = [m["content"] for s in runs["async"][1] for m in s["messages"] if m["role"] == "tool"]
    assert "12" in answers, answers
    assert [s["messages"] for s in runs["async"][1]] == [s["messages"] for s in runs["sync"][1]]
    assert not generators()


@pytest.mark.slow
def test_a_killed_trainer_leaves_neither_its_generator_nor_its_tools_processes(tool_model, tmp_path):
    """`grpo train` (async) whose tool keeps a process pool and is in a call (it waits) when
    the trainer gets SIGKILL: the generator and the pool's process end within seconds, and
    the run's folder goes with them."""
    config = run_config(tool_model, tmp_path, [{"prompt": MULTIPLY_PROMPT}] * 2, tools=TOOLS)
    config["rollout"]["tools"] = ["tests.rollout.tools_with_processes:kept", TOOLS[1]]
    config["rollout"]["async"] = {"max_staleness": 1}
    config["rewards"] = [{"function": "tests.train.test_tools_training:correct"}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GRPO_TEST_PIDS": str(pids)}
    run = subprocess.Popen(
        [sys.executable, "-m", "grpo", "train", str(path), "--quiet"],
        stderr=(tmp_path / "stderr").open("w"),
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not pids.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids.exists(), (tmp_path / "stderr").read_text()[-3000:]
        worker, pool = map(int, pids.read_text().split())
        folders = [f for f in Path("/dev/shm").glob("grpo-weights-*") if f"{run.pid}," in _owner(f)]
        assert running(worker) and running(pool) and worker != run.pid
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 10
        while (running(worker) or running(pool)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert not running(worker) and not running(pool), "a process outlived the trainer"
    assert not [f for f in folders if f.exists()]


def _owner(folder: Path) -> str:
    try:
        return (folder / "owner.json").read_text()
    except OSError:
        return ""


def test_a_trainer_that_exits_without_closing_its_generator_does_not_hang(make_config, tmp_path):
    """A script whose generator process has sampled a batch, and which exits without closing
    it: Python's exit (which joins every process that is no daemon) stops the generator first,
    so the script ends, and the generator with it."""
    config = make_config()
    config["rollout"]["async"] = {"max_staleness": 1}
    script = tmp_path / "unclosed.py"
    script.write_text(
        "from transformers import AutoModelForCausalLM\n"
        "from grpo.config import config_from_dict\n"
        "from grpo.rollout.generator import GeneratorSpec\n"
        "from grpo.rollout.worker import build_generator\n"
        'if __name__ == "__main__":\n'
        f"    c = config_from_dict({config!r})\n"
        "    generator = build_generator(GeneratorSpec.of(c, autocast=None), None, worker=True)\n"
        "    generator.publish(AutoModelForCausalLM.from_pretrained(c.model), 0)\n"
        "    generator.request(0, [{'prompt': '12'}])\n"
        "    generator.take(0)  # it serves\n"
        "    print(generator.process.pid, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not running(int(done.stdout.split()[0]))
