"""Asynchronous rollouts with a vLLM server (rollout.vllm.server with rollout.async.max_staleness
1): the generator process is the server's client. No server is one line before the first
step; each batch is drawn by the weights of the version it carries (pushed and checked
before it sampled); a batch older than K is dropped and sampled again; a K = 1 run learns,
one push per version; a server that hangs or is killed mid-run stops the run in one line
with its last step saved. A `grpo vllm-serve` subprocess (started once for the module) holds
a tiny tied Qwen2, as in test_server.py."""

import copy
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import grpo
from grpo.errors import UserError
from grpo.infra.checkpoint import list_checkpoints
from grpo.train.layouts import policy_logprobs
from tests.train.rewards_for_tests import sevens
from grpo.train.step import train_step
from tests.train.test_async import engine_for, schedule
from tests.train.test_learning import gain
from tests.vllm.models import assert_same_logprobs, save
from tests.vllm.test_server import Server, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the server is another process

_calls = {"n": 0}


def sevens_then_signal_server(prompts, completions, **columns):
    """`sevens`, but the Nth call ($GRPO_TEST_SERVER_AT) sends the process $GRPO_TEST_SERVER_PID
    (the server) $GRPO_TEST_SERVER_SIGNAL: KILL, a server that dies while the trainer scores a
    batch; STOP, one that hangs."""
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("GRPO_TEST_SERVER_AT", "0")):
        os.kill(int(os.environ["GRPO_TEST_SERVER_PID"]), getattr(signal, "SIG" + os.environ["GRPO_TEST_SERVER_SIGNAL"]))
    return sevens(prompts, completions)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save("qwen2", tmp_path_factory.mktemp("qwen2"), std=0.02))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("server") / "server.log")
    s.launch()
    yield s.wait()
    s.stop()


def pushes(server) -> int:
    with urllib.request.urlopen(f"http://{server.address}/health", timeout=10) as answer:
        return json.loads(answer.read())["pushes"]


def async_config(make_config, model_dir, address, *, steps=30, lr=1e-3, **rollout):
    config = make_config(train={"steps": steps, "lr": lr, "sample_every": 0})
    config["model"] = model_dir
    config["rollout"].update(sampler="vllm", vllm={"server": address}, **{"async": {"max_staleness": 1}}, **rollout)
    return config


def test_no_server_is_one_line_before_the_first_step(make_config, model_dir):
    address = f"127.0.0.1:{free_port()}"
    config = async_config(make_config, model_dir, address, steps=2)
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    message = str(err.value)
    assert message.startswith(f"rollout.async: the generator failed: no vLLM server answers at {address}"), message
    assert "\n" not in message
    assert not (Path(config["output_dir"]) / "metrics.jsonl").read_text()


def test_each_batch_is_drawn_by_the_version_it_carries_and_one_older_than_k_is_dropped(make_config, model_dir, server):
    """A schedule two steps ahead with K = 1: batches two versions old are dropped and sampled
    again. Every trained batch's log-probs are those of the weights of the version it carries
    (the trainer kept a copy of each), not those of the version after it: the server sampled
    with the weights the generator pushed, checked, and stamped."""
    config = async_config(make_config, model_dir, server.address, steps=5, lr=1e-2, min_new_tokens=0)
    c, e, rows, _ = engine_for(config)  # min_new_tokens 0: the engine's log-probs are the trainer's
    rollouts = schedule(c, e, rows, ahead=2)
    versions, trained = {}, []
    try:
        for step in range(c.train.steps):
            versions[e.version] = copy.deepcopy(e.policy)
            sampled, taken = rollouts.take(e, step)
            result = train_step(e, sampled, step)
            result.metrics.update({**taken, **rollouts.after_update(e)})
            trained.append((result.rollout, result.metrics))
    finally:
        rollouts.close()
    versions[e.version] = e.policy
    metrics = [m for _, m in trained]
    assert all(m["async/staleness"] <= 1 for m in metrics), [m["async/staleness"] for m in metrics]
    assert sum(m["async/dropped"] for m in metrics) >= 2 and max(m["async/staleness_max"] for m in metrics) == 2
    for rollout, _ in trained:
        valid = rollout.completion_mask.bool()
        with torch.no_grad():
            drawn = policy_logprobs(versions[rollout.policy_version], rollout, c.rollout.temperature)
            later = policy_logprobs(versions[rollout.policy_version + 1], rollout, c.rollout.temperature)
        assert_same_logprobs(rollout.sampled_logprobs[valid], drawn[valid])
        assert (rollout.sampled_logprobs[valid] - later[valid]).abs().max() > 1e-2  # the test can tell versions


@pytest.mark.learning
def test_async_k1_through_the_server_learns_with_one_push_per_version(make_config, model_dir, server):
    before = pushes(server)
    result = grpo.train(async_config(make_config, model_dir, server.address), progress=False)
    m = result.metrics
    assert gain(m) >= 0.25, [round(x["reward/mean"], 3) for x in m]
    assert [x["async/staleness"] for x in m] == [0] + [1] * 29  # the first batch has nothing to lag
    assert result.summary["async"]["dropped"] == 0 and result.summary["async"]["staleness_max"] == 1
    assert pushes(server) - before == 29  # versions 0..28 drew the 30 batches, each pushed once


def signalling_config(make_config, model_dir, server, monkeypatch, name: str) -> dict:
    """A 6-step run whose second reward call sends the server SIG`name`."""
    config = async_config(make_config, model_dir, server.address, steps=6)
    config["rewards"] = [{"function": "tests.vllm.test_server_async:sevens_then_signal_server"}]
    monkeypatch.setenv("GRPO_TEST_SERVER_AT", "2")
    monkeypatch.setenv("GRPO_TEST_SERVER_PID", str(server.process.pid))
    monkeypatch.setenv("GRPO_TEST_SERVER_SIGNAL", name)
    monkeypatch.setitem(_calls, "n", 0)
    return config


def test_a_server_that_hangs_is_one_line_within_the_request_timeout(make_config, model_dir, server, monkeypatch):
    """Stopped (SIGSTOP) while the trainer scores step 2: the generator's next request gets no
    answer within rollout.vllm.timeout, and the run stops with that line, not a silent wait."""
    config = signalling_config(make_config, model_dir, server, monkeypatch, "STOP")
    config["rollout"]["vllm"]["timeout"] = 10
    config["rollout"]["async"]["timeout"] = 60  # the trainer's own bound, should the request's fail
    start = time.monotonic()
    try:
        with pytest.raises(UserError) as err:
            grpo.train(config, progress=False)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    message = str(err.value)
    assert "\n" not in message and time.monotonic() - start < 120
    assert message.startswith(
        f"rollout.async: the generator failed: the vLLM server at {server.address} gave no answer within 10 s"
    ), message
    assert message.endswith("saved: fix the cause and continue with --resume]"), message


def test_a_server_killed_mid_run_is_one_line_with_the_last_step_saved(make_config, model_dir, server, monkeypatch):
    """Killed while the trainer scores step 2: the generator's next push or request fails, and
    the run stops with its one line and a checkpoint. Runs last: it kills the module's server."""
    config = signalling_config(make_config, model_dir, server, monkeypatch, "KILL")
    config["rollout"]["async"]["timeout"] = 120
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"rollout.async: the generator failed: the vLLM server at {server.address} stopped"), (
        message
    )
    saved = [p.name for p in list_checkpoints(Path(config["output_dir"]))]
    assert saved in (["step-000002"], ["step-000003"]), saved  # the batch sampled ahead may have been drawn
    assert message.endswith(
        f"[checkpoint of {saved[0].replace('-00000', ' ')} saved: fix the cause and continue with --resume]"
    )
