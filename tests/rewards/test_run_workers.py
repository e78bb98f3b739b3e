"""Workers belong to a run (`grpo.infra.contain.run_workers`): a run's isolated reward and tool
workers stop when it ends, however it ends, and the next run in the process imports the
user's code afresh, isolated or not."""

import glob
import multiprocessing
import os
import sys

import pytest

import grpo
from grpo.errors import UserError
from grpo.infra import contain
from grpo.rewards import load_rewards

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc for child processes")

MODULE = "tests.rewards.rewards_for_containment"
EDITED = "edited_reward_for_runs"  # the module each test writes into its tmp_path


def _children() -> set[int]:
    """The ids of this process's living children, whoever started them."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids.update(int(pid) for pid in f.read().split())
    return pids


@pytest.fixture
def edited(tmp_path, monkeypatch):
    """write(text): the reward module `EDITED`, written into tmp_path (on sys.path)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, EDITED, raising=False)
    yield lambda text: (tmp_path / f"{EDITED}.py").write_text(text)
    sys.modules.pop(EDITED, None)
    contain.stop_workers()


def _constant(value: float) -> str:
    return f"def reward(completions, **kwargs):\n    return [{value!r}] * len(completions)\n"


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "here"])
def test_a_second_run_in_the_process_runs_the_edited_reward_and_leaves_no_child(make_config, edited, isolate):
    before = _children()
    config = make_config(rewards=[{"function": f"{EDITED}:reward", "isolate": isolate}], train={"steps": 1})
    means = []
    # Different lengths: Python trusts a cached .pyc whose source has the same size and second.
    for value in (0.25, 0.875):
        edited(_constant(value))
        result = grpo.train(config, overwrite=True, progress=False)
        means.append(result.metrics[-1]["reward/mean"])
        assert _children() == before and not multiprocessing.active_children()
    assert means == pytest.approx([0.25, 0.875], rel=1e-6)


def test_a_run_that_fails_midway_leaves_no_child(make_config, edited):
    """The isolated reward scores the first step, then raises: the run fails, its worker alive
    (a function's error does not end its worker), and stopped with the run."""
    edited(
        "CALLS = [0]\n"
        "def reward(completions, **kwargs):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] > 1:\n        raise ValueError('boom')\n"
        "    return [1.0] * len(completions)\n"
    )
    before = _children()
    config = make_config(rewards=[{"function": f"{EDITED}:reward", "isolate": True}], train={"steps": 3})
    with pytest.raises(UserError, match=f"^reward '{EDITED}:reward'.*boom"):
        grpo.train(config, progress=False)
    with open(os.path.join(config["output_dir"], "metrics.jsonl")) as f:
        assert len(f.read().splitlines()) == 1  # the first step was scored
    assert _children() == before and not multiprocessing.active_children()


def _isolated():
    return load_rewards([(f"{MODULE}:length", 1.0)], [{"isolate": True}])[0]


def _call_and_pid(reward) -> int:
    contain.call(reward, ["q"], ["abc"], {})
    return contain._workers[("reward", reward.spec)].process.pid


def test_a_run_stops_its_workers_on_ctrl_c_leaves_others_and_shares_them_with_nested_runs():
    reward = _isolated()
    try:
        outside = _call_and_pid(reward)  # started outside any run: not the run's
        with pytest.raises(KeyboardInterrupt):
            with contain.run_workers():
                ours = _call_and_pid(reward)
                assert ours != outside  # a run starts its own, never one from before it
                with contain.run_workers():  # nested (a demo's evaluation): the same workers
                    assert _call_and_pid(reward) == ours
                assert ours in _children()  # the nested scope's end stopped nothing
                raise KeyboardInterrupt
        assert ours not in _children() and outside in _children()
        assert contain._workers[("reward", reward.spec)].process.pid == outside
    finally:
        contain.stop_workers()
    assert outside not in _children()


def test_a_spec_reads_its_module_again_only_when_its_file_changed(edited):
    edited(_constant(1.0))
    first = load_rewards([(f"{EDITED}:reward", 1.0)])[0].fn
    assert load_rewards([(f"{EDITED}:reward", 1.0)])[0].fn is first  # unchanged: the module as imported
    edited(_constant(2.25))  # another length: see above
    second = load_rewards([(f"{EDITED}:reward", 1.0)])[0].fn
    assert second(completions=["a"]) == [2.25] and first(completions=["a"]) == [1.0]
