"""Server mode between two processes on this machine: a `grpo vllm-serve` subprocess (started
once for the module) holds a tiny tied Qwen2; the trainer (this process) reaches it through
`rollout.vllm.server`. Its log-probs of its samples are the trainer's before and after weight
pushes; GRPO learns through it; a server that is not there, holds another model, or is
killed mid-run stops the run in one line (the last, with its last step saved, which resumes)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import grpo
from grpo.cli import main
from grpo.errors import UserError
from grpo.infra.checkpoint import list_checkpoints
from grpo.rollout import Sampler
from grpo.tasks.tiny import char_tokenizer
from grpo.infra.hf import load_causal_lm
from grpo.train.layouts import policy_logprobs
from grpo.vllm import client
from grpo.vllm.client import RemoteEngine, identity
from grpo.vllm.decoder import EngineOptions
from grpo.vllm.engine import policy_weights
from tests.train.test_learning import gain
from tests.vllm.models import ALPHABET, WORST_GAP, assert_same_logprobs, save
from tests.vllm.test_engine import update

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # the server is another process

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = char_tokenizer(ALPHABET)
ROWS = [{"prompt": "ab"}, {"prompt": "hello world"}, {"prompt": "7"}, {"prompt": "the quick brown fox " * 6}]
MAX_LEN = 192


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m grpo vllm-serve` in a subprocess of this interpreter (the vLLM venv's)."""

    def __init__(self, model: str, log: Path):
        self.model, self.log, self.process, self.info = model, log, None, None
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def launch(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", self.model, "--port", str(self.port)]
        command += ["--max-model-len", str(MAX_LEN), "--max-num-seqs", "32", "--device", "cpu"]
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait(self, timeout: float = 240.0) -> "Server":
        """Until it answers its health request (its engine is built by then)."""
        deadline = time.monotonic() + timeout
        while self.info is None and time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://{self.address}/health", timeout=2) as answer:
                    self.info = json.loads(answer.read())
            except OSError:
                time.sleep(0.5)
        if self.info is None:
            self.stop()
            raise AssertionError(f"the server did not answer within {timeout} s:\n{self.log.read_text()[-3000:]}")
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny tied Qwen2 (head_dim 64, QKV bias), initialised near uniform as transformers does."""
    return str(save("qwen2", tmp_path_factory.mktemp("qwen2"), std=0.02))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """The module's server, and a spare for the run that resumes after its server was killed,
    both started at once (each start is mostly one thread of imports and set-up)."""
    logs = tmp_path_factory.mktemp("servers")
    pair = [Server(model_dir, logs / f"{name}.log") for name in ("server", "spare")]
    for server in pair:
        server.launch()
    yield pair
    for server in pair:
        server.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0].wait()


@pytest.fixture
def policy(model_dir):
    return load_causal_lm(model_dir, "float32")


def sampler(server, **kw) -> Sampler:
    """A Sampler of G = 4 that samples with the server."""
    engine = EngineOptions(max_model_len=MAX_LEN, server=server.address)
    kw = {"max_new_tokens": 12, "prompt_column": "prompt", "group_size": 4, "seed": 0, **kw}
    return Sampler(TOKENIZER, backend="vllm", decoder_options={"vllm": {"options": engine}}, **kw)


def assert_scored_as_the_trainer(policy, rollout, temperature=1.0, penalty=1.0):
    with torch.no_grad():
        scored = policy_logprobs(policy, rollout, temperature, penalty)  # (N, T)
    valid = rollout.completion_mask.bool()
    assert valid.sum() > 20
    assert_same_logprobs(rollout.sampled_logprobs[valid], scored[valid])


def test_the_server_holds_the_directory_s_model_and_weights(server, policy):
    info = server.info
    assert info["identity"] == identity(policy.config) and info["dtype"] == "float32"
    assert info["grpo"] == grpo.__version__ and info["vllm"] and info["max_model_len"] == MAX_LEN
    engine = RemoteEngine(server.address)
    assert engine.check(policy, 1e-3) < WORST_GAP  # the directory's weights, tied head included, before any push


def test_pushed_weights_give_the_trainer_s_log_probs_after_two_updates(server, policy, monkeypatch):
    folders, make = [], client.weights_folder

    def recorded(*args, **kwargs):
        folders.append(make(*args, **kwargs))
        return folders[-1]

    monkeypatch.setattr(client, "weights_folder", recorded)
    s = sampler(server, temperature=0.7, repetition_penalty=1.3)  # every option reaches the server
    before = s.sample(policy, ROWS, version=0)
    assert_scored_as_the_trainer(policy, before, 0.7, 1.3)
    engine = s.decoders["vllm"].engine
    assert engine.holds[1] == 0
    pushes = engine.syncs
    update(policy)
    after = s.sample(policy, ROWS, version=2)
    assert engine.holds[1] == 2 and engine.syncs == pushes + 1
    assert_scored_as_the_trainer(policy, after, 0.7, 1.3)
    with torch.no_grad():  # the weights moved: the old samples score otherwise now
        rescored = policy_logprobs(policy, before, 0.7, 1.3)
    valid = before.completion_mask.bool()
    assert (rescored[valid] - before.sampled_logprobs[valid]).abs().max() > 0.05
    assert len(folders) >= 2 and not [f for f in folders if os.path.exists(f)]  # each push's file deleted


def test_seeded_requests_draw_the_same_tokens_and_n_per_prompt(server, policy):
    first = sampler(server).sample(policy, ROWS, step=3)
    again = sampler(server).sample(policy, ROWS, step=3)
    other = sampler(server).sample(policy, ROWS, step=4)
    assert first.completion_ids.shape[0] == len(ROWS) * 4
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_weights_another_process_pushed_are_refused_not_sampled(server, policy):
    """Two trainers on one server: the first one's next request is refused in one line."""
    s = sampler(server)
    s.sample(policy, ROWS, version=0)
    RemoteEngine(server.address).load_weights(policy_weights(policy))  # another trainer's push
    with pytest.raises(UserError, match="refused generation: it holds other weights than this trainer pushed"):
        s.sample(policy, ROWS, version=0)


def run_config(make_config, model, address, **train):
    config = make_config(train={"steps": 30, "lr": 1e-3, "sample_every": 0, **train})
    config["model"] = model
    config["rollout"].update(sampler="vllm", vllm={"server": address})
    return config


@pytest.mark.learning
def test_grpo_through_the_server_learns(make_config, model_dir, server, monkeypatch):
    clients, make = [], client.remote_engine
    monkeypatch.setattr(client, "remote_engine", lambda *args: clients.append(make(*args)) or clients[-1])
    result = grpo.train(run_config(make_config, model_dir, server.address), progress=False)
    assert gain(result.metrics) >= 0.25, [round(m["reward/mean"], 3) for m in result.metrics]
    (engine,) = clients  # one client for the run
    assert engine.holds[1] == 29  # pushed after every update


def test_no_server_is_one_line_before_the_first_step(make_config, model_dir, tmp_path, capsys):
    port = free_port()
    config = run_config(make_config, model_dir, f"127.0.0.1:{port}")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["train", str(path), "--quiet"]) == 2
    line = f"no vLLM server answers at 127.0.0.1:{port} (start one with: grpo vllm-serve --model DIR --port {port})"
    assert capsys.readouterr().err.strip().splitlines() == [f"grpo: error: {line}"]
    assert not (Path(config["output_dir"]) / "metrics.jsonl").exists()


def test_a_server_holding_another_model_is_one_line(make_config, server, tmp_path):
    llama = str(save("llama", tmp_path / "llama"))
    with pytest.raises(
        UserError, match=r"^the vLLM server at .* holds another model \(.*model_type: qwen2 there, llama here"
    ) as err:
        grpo.train(run_config(make_config, llama, server.address, steps=2), progress=False)
    assert "\n" not in str(err.value)


def test_a_server_killed_mid_run_stops_it_in_one_line_with_its_last_step_saved(
    make_config, model_dir, servers, monkeypatch
):
    """Killed (SIGKILL) just before the third push: step 2 is saved; the run resumes from it
    with the spare server and finishes. Runs last: it kills the module's server."""
    server, spare = servers
    server.wait()
    push, pushes = RemoteEngine.load_weights, []

    def killing(engine, weights):
        pushes.append(1)
        if len(pushes) == 3:  # before step 3's samples: steps 1 and 2 done
            server.stop()
        return push(engine, weights)

    monkeypatch.setattr(RemoteEngine, "load_weights", killing)
    config = run_config(make_config, model_dir, server.address, steps=4)
    with pytest.raises(UserError) as err:
        grpo.train(config, progress=False)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"the vLLM server at {server.address} stopped answering during the weight push")
    assert message.endswith("[checkpoint of step 2 saved: fix the cause and continue with --resume]")
    assert [p.name for p in list_checkpoints(Path(config["output_dir"]))] == ["step-000002"]
    monkeypatch.setattr(RemoteEngine, "load_weights", push)
    spare.wait()
    resumed = grpo.train(config, overrides=[f"rollout.vllm.server={spare.address}"], resume=True, progress=False)
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4]
