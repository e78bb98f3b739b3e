"""The fork server that starts the demo's runs (grpo/infra/forkserver.py): a run forked from
it is the run a new interpreter would train, its exit status and error line come back, and
no way a child or the server ends leaves a caller waiting."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from grpo.errors import UserError
from grpo.infra import forkserver
from grpo.infra.child import child_env, run_starter, train_in_child

pytestmark = [
    pytest.mark.skipif(not forkserver.available(), reason="the fork server runs on Linux only"),
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def server():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
    try:
        s = forkserver.ForkServer(env=child_env(1))
    finally:
        signal.signal(signal.SIGINT, previous)
    with s:
        yield s


def test_a_forked_run_trains_what_a_new_interpreter_trains(tmp_path, make_config, tiny_model):
    fresh = make_config(output_dir=str(tmp_path / "fresh"))
    fresh = train_in_child(fresh, tmp_path / "fresh.yaml", progress=False, threads=1)
    with run_starter(1, [tiny_model]) as starter:
        assert starter is not None
        forked = make_config(output_dir=str(tmp_path / "forked"))
        forked = train_in_child(forked, tmp_path / "forked.yaml", progress=False, threads=1, starter=starter)
    keys = ("loss", "reward/mean", "kl", "grad_norm", "completion_length/mean")
    assert len(forked["metrics"]) == 4
    assert [[m[k] for k in keys] for m in forked["metrics"]] == [[m[k] for k in keys] for m in fresh["metrics"]]
    assert (tmp_path / "forked" / "final" / "config.json").exists()


def test_a_failed_run_raises_its_own_error_line(tmp_path, make_config, server):
    config = make_config(output_dir=str(tmp_path / "bad"))
    config["train"]["lr"] = -1.0
    with pytest.raises(UserError, match=r"training bad.yaml failed: grpo: error: train.lr: must be > 0"):
        train_in_child(config, tmp_path / "bad.yaml", progress=False, threads=1, starter=server)


def test_exit_codes_signals_and_calls_side_by_side(server):
    assert server.call("os:_exit", [7]) == 7
    assert server.call("torch:get_num_threads", []) == 1  # the helper's environment: OMP_NUM_THREADS=1
    assert server.call("time:sleep", [0]) == 0  # None returned: 0
    assert server.call("os:abort", []) == -signal.SIGABRT  # killed by a signal: minus it, as subprocess says
    assert server.call("json:loads", ["{"]) == 1  # an exception: 1 (its traceback on the child's stderr)
    codes = {}

    def slow():
        codes["slow"] = server.call("time:sleep", [1.5])

    thread = threading.Thread(target=slow)
    started = time.perf_counter()
    thread.start()
    time.sleep(0.2)
    assert server.call("os:_exit", [3]) == 3  # answered while the other child still runs
    assert time.perf_counter() - started < 1.5 and "slow" not in codes
    thread.join()
    assert codes["slow"] == 0


def test_the_child_output_goes_where_asked(tmp_path, server):
    out = tmp_path / "out.txt"
    assert server.run(["--version"], stdout=out) == 0
    assert out.read_text().startswith("grpo ")


def test_closing_the_server_stops_its_children_and_answers_their_callers():
    s = forkserver.ForkServer()
    codes = []
    thread = threading.Thread(target=lambda: codes.append(s.call("time:sleep", [60])))
    thread.start()
    time.sleep(3)  # the helper has imported what it preloads and forked
    started = time.perf_counter()
    s.close()
    thread.join(timeout=30)
    assert codes == [-signal.SIGTERM] and time.perf_counter() - started < 20


def test_a_dead_server_raises_instead_of_hanging():
    s = forkserver.ForkServer()
    errors = []

    def wait():
        try:
            s.call("time:sleep", [2])
        except forkserver.ServerGone as err:
            errors.append(str(err))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(3)
    s._process.kill()
    thread.join(timeout=30)
    assert not thread.is_alive() and errors and "exited" in errors[0]
    with pytest.raises(forkserver.ServerGone):
        s.call("time:sleep", [0])
    s.close()


def test_the_child_handles_ctrl_c_as_the_caller_does(server):
    """A run forked from the helper stops on Ctrl-C where its caller would (KeyboardInterrupt:
    130), and ignores it where its caller ignores it (a script's background job), as a new
    interpreter started by that caller would."""
    assert server.call("signal:raise_signal", [signal.SIGINT]) == 130
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignoring = forkserver.ForkServer()
    finally:
        signal.signal(signal.SIGINT, previous)
    with ignoring:
        assert ignoring.call("signal:raise_signal", [signal.SIGINT]) == 0
